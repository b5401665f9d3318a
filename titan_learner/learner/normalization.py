"""A step's loss is the mean over every token (or row) of the step, whatever the split.

TorchRL's GRPO-family losses average inside the batch they see: `token_mean` over its response
tokens, `prompt_mean` over its rows. A step split over data-parallel ranks and accumulation
micro-batches would then average the per-split means, over-weighting the tokens of short
responses (a rank or micro-batch with few tokens counts as much as one with many). Instead,
each micro-batch's term is scaled before backward by

    scale = data_parallel_size * accumulation_steps * (its count) / (the step's count)

where the counts are the term's own: trained tokens (`token_mean`, and the KL terms), rows
(`prompt_mean`), or one per micro-batch (a loss whose normalization is unknown: the old mean of
means). FSDP averages gradients over data-parallel ranks and the stepper divides by the
accumulation steps, so the gradients sum to those of the global mean: one optimizer step equals
the one-process step on the concatenated batch.

The step's count must be known before its first backward. `update(micro, step_counts=...)` is
given the rank's counts of its whole step (`step_counts(micro_batches)`); the learner sums them
over data-parallel ranks once per window. Without them, each micro-batch is normalized by its
own count over data-parallel ranks (exact whenever the window is one micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY

TOKENS, ROWS, CALLS = "tokens", "rows", "calls"
KINDS = (TOKENS, ROWS, CALLS)
KL_TERMS = ("loss_kl_to_ref", "loss_kl_to_inference")
MAX_SUFFIX = "_max"  # a diagnostic reported as its largest value, not a weighted mean


def micro_batch_counts(batch: TensorDictBase) -> dict[str, float]:
    """What one micro-batch holds: trained tokens (response positions with a behaviour
    log-prob, the positions the loss masks in), rows, and one call."""
    trained = batch.get(ASSISTANT_MASK_KEY) & torch.isfinite(batch.get(LOG_PROBS_KEY))
    return {TOKENS: float(trained.sum()), ROWS: float(batch.batch_size[0]), CALLS: 1.0}


def step_counts(micro_batches: Iterable[TensorDictBase]) -> dict[str, float]:
    """This rank's counts over all the micro-batches of one optimizer step (no collective)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for micro in micro_batches:
        for kind, count in micro_batch_counts(micro).items():
            totals[kind] += count
    return totals


def term_kind(loss_module: nn.Module, key: str) -> str:
    """Which count a term of the loss output is a mean over.

    Loss terms follow the loss's `aggregation`; the KL terms are token means when the loss
    takes them over response tokens (`TokenMeanKL`); diagnostics are reported token-weighted.
    """
    from titan_learner.learner.losses import TokenMeanKL

    if not key.startswith("loss"):
        return TOKENS
    if key in KL_TERMS:
        return TOKENS if isinstance(loss_module, TokenMeanKL) else CALLS
    aggregation = getattr(loss_module, "aggregation", None)
    return {"token_mean": TOKENS, "prompt_mean": ROWS}.get(aggregation, CALLS)


def check_counts(counts: Mapping[str, float]) -> dict[str, float]:
    """`step_counts` as the learner takes it: every kind, non-negative numbers."""
    if not isinstance(counts, Mapping) or set(counts) != set(KINDS):
        raise ValueError(
            f"step_counts must be a mapping with keys {', '.join(KINDS)} (from "
            f"titan_learner.learner.normalization.step_counts), got {counts!r}"
        )
    checked = {kind: float(counts[kind]) for kind in KINDS}
    if any(not value >= 0 for value in checked.values()):
        raise ValueError(f"step_counts must be >= 0, got {counts!r}")
    return checked


class WindowMetrics:
    """The metrics of an accumulation window so far, over data-parallel ranks.

    Each term is weighted by its own count (a loss term like the loss normalizes it, a
    diagnostic by trained tokens); on the call that closes the window the loss terms are
    exactly the step's global loss terms. A term named `*_max` is the largest value instead.
    `result` costs one all-reduce (two with `*_max` terms); `add` none.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxima: dict[str, float] = {}

    def add(
        self, terms: Mapping[str, torch.Tensor], counts: Mapping[str, float], loss_module: nn.Module
    ) -> None:
        """One micro-batch's terms, weighted by its counts (no collective)."""
        for key, value in terms.items():
            if key.endswith(MAX_SUFFIX):
                if counts[TOKENS] > 0:  # a maximum over no trained token says nothing
                    self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))
                else:
                    self.maxima.setdefault(key, -math.inf)
                continue
            weight = counts[term_kind(loss_module, key)]
            self.sums.setdefault(key, 0.0)
            self.weights.setdefault(key, 0.0)
            if weight > 0:  # a term over nothing (no trained token) says nothing
                self.sums[key] += weight * float(value)
                self.weights[key] += weight

    def result(
        self,
        reduce_sum: Callable[[dict[str, float]], dict[str, float]],
        reduce_max: Callable[[dict[str, float]], dict[str, float]],
    ) -> TensorDict:
        """The window so far over data-parallel ranks (the collectives)."""
        keys = sorted(self.sums)
        local = {
            **{("sum", k): self.sums[k] for k in keys},
            **{("w", k): self.weights[k] for k in keys},
        }
        total = reduce_sum(local)
        largest = reduce_max(dict(self.maxima)) if self.maxima else {}
        return TensorDict(
            {
                **{
                    k: torch.tensor(
                        total[("sum", k)] / total[("w", k)] if total[("w", k)] > 0 else 0.0,
                        dtype=torch.float32,
                    )
                    for k in keys
                },
                **{
                    k: torch.tensor(v if math.isfinite(v) else 0.0, dtype=torch.float32)
                    for k, v in largest.items()
                },
            },
            batch_size=[],
        )
