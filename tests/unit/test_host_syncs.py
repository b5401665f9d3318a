"""update() reads device values back to the host only where it must.

On a GPU every such read (a `nonzero`, a boolean index, `.item()`, `bool()`, `.tolist()`)
waits for all the kernels queued so far, and the launch queue runs dry meanwhile. Counted on
CPU: the operations that would read the device, issued during one `update` by the project's own
code (TorchRL's loss and stepper make their own, attributed to them and not counted).
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.models import batches, tiny_config
from titan_learner.learner.batch import TOKENS_KEY
from titan_learner.learner.local import LocalLearner

READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default"}

# Where the learner's own code reads the device in one update, and why each must:
EXPECTED = Counter(
    {
        "check_and_count": 1,  # the batch's values, checked before any compute
        "_agree": 1,  # the loss is finite on every rank, and the step's counts
        "values": 1,  # the metrics, once, after the optimizer step
        "step": 1,  # the gradient norm, for the stepper's non-finite guard (as TorchRL's does)
    }
)


def owner(package: str = "titan_learner") -> str | None:
    """The function of ours that issued the current operation, or None if it was not ours:
    the innermost frame outside torch decides (TorchRL's calls belong to TorchRL). Reads inside
    torch.optim's update belong to torch whoever calls it (the learner's Adam calls torch's
    `adam` on local shards: the same per-parameter reads of its CPU step counters as torch's own
    step, which no GPU waits for)."""
    stack = traceback.extract_stack()[:-2]
    if any("/torch/optim/" in frame.filename.replace("\\", "/") for frame in stack):
        return None
    for frame in reversed(stack):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("test_host_syncs.py"):
            continue
        return frame.name if f"/{package}/" in path else None
    return None


class DeviceReads(TorchDispatchMode):
    def __init__(self, package: str = "titan_learner") -> None:
        super().__init__()
        self.package = package
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = str(func) == "aten.index.Tensor" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if (str(func) in READS or boolean_index) and (name := owner(self.package)) is not None:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


# How many positions are scored, read before the decoder's forward: by the chunked path, not
# by a batch that fits one chunk (scored whole, titan_learner.learner.forward.justified_stats).
SCORED_POSITIONS = Counter({"token_dist": 1})


@pytest.mark.parametrize(
    ("learner_section", "reads"),
    [
        ({}, EXPECTED),
        ({"logprob_chunk_size": 16}, EXPECTED + SCORED_POSITIONS),
        ({"share_prompts": True}, EXPECTED + SCORED_POSITIONS),
    ],
    ids=["one chunk", "chunks", "shared prompts"],
)
def test_one_update_reads_the_device_only_where_it_must(monkeypatch, learner_section, reads):
    """A batch that fits one chunk is scored without a read; in chunks, the scored positions
    are counted once (sharing prompts, the stream's size in the same read)."""
    learner = LocalLearner(tiny_config(learner=learner_section))
    assert learner.config.learner.logprob_chunk_size > 0  # a chunked path
    shared = learner.config.learner.share_prompts
    first, second = batches(2, varied=not shared, grouped=shared)
    fits = second.get(TOKENS_KEY).numel() <= learner.config.learner.logprob_chunk_size
    assert fits == ("logprob_chunk_size" not in learner_section)  # the default chunk holds it
    learner.update(first)  # lazy initialization outside the count
    counter = DeviceReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        if (name := owner()) is not None:
            counter.reads[name] += 1
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with counter:
        metrics = learner.update(second)
    assert "grad_norm" in metrics.keys()  # a whole optimizer step was counted
    assert counter.reads == reads


def test_torchrl_loss_code_reads_the_device_nowhere():
    """TorchRL's forward would read twice: its ESS diagnostic (a boolean index) and its entropy
    check (`isfinite().all()`). The learner's loss takes the ESS without one
    (`losses.LeanForward`), skips the check on the chunked distribution
    (`losses.ChunkedEntropy`) and does not recompute the clip bounds (`CachedClipBounds`):
    the TorchRL code it still runs reads nothing."""
    learner = LocalLearner(tiny_config())
    first, second = batches(2, varied=True)
    learner.update(first)
    counter = DeviceReads(package="torchrl")
    with counter:
        learner.update(second)
    assert counter.reads == Counter()
