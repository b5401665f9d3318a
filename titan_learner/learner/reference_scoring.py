"""Reference log-probs joined to a batch, scored in the micro-batches its step will take.

A frozen reference's forward (the KL anchor, job.reference.ReferenceModel) is a collective and
holds activations like the update's own forward: scoring it in the same pieces as the update
bounds its memory the same way. The reference is anything with `kl_log_probs(batch)`; the
learner never imports the job's model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from tensordict import TensorDictBase

from titan_learner.learner.batch import REF_LOG_PROBS_KEY


class Reference(Protocol):
    def kl_log_probs(self, batch: TensorDictBase) -> torch.Tensor: ...


def with_reference_log_probs(
    batch: TensorDictBase, reference: Reference, parts: int
) -> TensorDictBase:
    """The batch with the reference's log-probs (`Reference.kl_log_probs`), scored in `parts`
    pieces, the micro-batches the update takes: a collective, bounded like the update."""
    scored = torch.cat([reference.kl_log_probs(part) for part in batch.chunk(parts)])
    out = batch.clone(recurse=False)
    out.set(REF_LOG_PROBS_KEY, scored)
    return out
