"""A step's loss is the mean over every token (or row) of the step, whatever the split.

TorchRL's GRPO-family losses average inside the batch they see: `token_mean` over its response
tokens, `prompt_mean` over its rows. A step split over data-parallel ranks and accumulation
micro-batches would then average the per-split means, over-weighting the tokens of short
responses (a rank or micro-batch with few tokens counts as much as one with many). Instead,
each micro-batch's term is scaled before backward by

    scale = data_parallel_size * accumulation_steps * (its count) / (the step's count)

where the counts are the term's own: trained tokens (`token_mean`, and the KL terms), rows
(`prompt_mean`, `seq_mean_token_sum`, `seq_mean_token_sum_norm`), or one per micro-batch (a loss module of the user's own that declares no
`aggregation`: the mean of means). An aggregation not in `AGGREGATION_COUNTS` is refused: any
weighting picked for it would train another objective without a word. FSDP averages gradients
over data-parallel ranks and the stepper divides by the accumulation steps, so the gradients
sum to those of the global mean: one optimizer step equals the one-process step on the
concatenated batch.

The step's count must be known before its first backward. `update(micro, step_counts=...)` is
given the rank's counts of its whole step (`step_counts(micro_batches)`); the learner sums them
over data-parallel ranks once per window. Without them, each micro-batch is normalized by its
own count over data-parallel ranks (exact whenever the window is one micro-batch); with several
micro-batches a window and a loss that averages over counts, that is a different objective, so
`update` refuses it unless the caller asks for it (`per_microbatch_mean=True`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY, trained_tokens
from titan_learner.learner.loss.losses import TokenMeanKL

TOKENS, ROWS, CALLS = "tokens", "rows", "calls"
KINDS = (TOKENS, ROWS, CALLS)
KL_TERMS = ("loss_kl_to_ref", "loss_kl_to_inference")
AGGREGATION_COUNTS = {
    "token_mean": TOKENS,
    "prompt_mean": ROWS,
    "seq_mean_token_sum": ROWS,
    "seq_mean_token_sum_norm": ROWS,  # the sum over tokens / (rows x a constant)
}
"""The count each aggregation's terms are means over: exactly [loss] aggregation's allowed
values (`titan_learner.config.loss_values.AGGREGATIONS`)."""
MAX_SUFFIX = "_max"  # a diagnostic reported as its largest value, not a weighted mean


def micro_batch_counts(batch: TensorDictBase) -> dict[str, float]:
    """What one micro-batch holds: trained tokens (response positions with a behaviour
    log-prob, the positions the loss masks in), rows, and one call."""
    trained = trained_tokens(batch.get(ASSISTANT_MASK_KEY), batch.get(LOG_PROBS_KEY))
    return counts_of(float(trained), batch.batch_size[0])


def counts_of(tokens: float, rows: int) -> dict[str, float]:
    """The counts of a micro-batch of `rows` rows that trains `tokens` tokens."""
    return {TOKENS: float(tokens), ROWS: float(rows), CALLS: 1.0}


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
    if not key.startswith("loss"):
        return TOKENS
    if key in KL_TERMS:
        return TOKENS if isinstance(loss_module, TokenMeanKL) else CALLS
    return aggregation_kind(loss_module)


def aggregation_kind(loss_module: nn.Module) -> str:
    """The count the loss module's terms are means over, from its `aggregation`; per call
    for a module that declares none. Raises for an aggregation the learner does not know."""
    if not hasattr(loss_module, "aggregation"):
        return CALLS
    aggregation = loss_module.aggregation
    kind = AGGREGATION_COUNTS.get(aggregation) if isinstance(aggregation, str) else None
    if kind is None:
        allowed = ", ".join(repr(name) for name in AGGREGATION_COUNTS)
        raise ValueError(
            f"{type(loss_module).__name__}.aggregation = {aggregation!r} has no normalization "
            f"across micro-batches and ranks; allowed: {allowed}"
        )
    return kind


def averaged_over_counts(loss_module: nn.Module) -> str | None:
    """What of the loss is a mean over the batch's tokens or rows (None: nothing is), i.e.
    what a micro-batch normalized over its own counts would weigh differently from the step."""
    aggregation = getattr(loss_module, "aggregation", None)
    if aggregation in AGGREGATION_COUNTS:
        return f"aggregation {aggregation}"
    kl = [c for c in ("kl_to_ref_coeff", "kl_to_inference_coeff") if getattr(loss_module, c, None)]
    if kl and isinstance(loss_module, TokenMeanKL):
        return f"{' and '.join(kl)} (token means)"
    return None


def check_counts(counts: Mapping[str, float]) -> dict[str, float]:
    """`step_counts` as the learner takes it: every kind, non-negative numbers."""
    if not isinstance(counts, Mapping) or set(counts) != set(KINDS):
        raise ValueError(
            f"step_counts must be a mapping with keys {', '.join(KINDS)} (from "
            f"titan_learner.step_counts), got {counts!r}"
        )
    checked = {kind: float(counts[kind]) for kind in KINDS}
    if any(not value >= 0 for value in checked.values()):
        raise ValueError(f"step_counts must be >= 0, got {counts!r}")
    return checked


class StepNormalization:
    """The loss scales of each micro-batch, from counts summed over data-parallel ranks.

    `begin` (before the forward) says which local counts must be summed over ranks for this
    micro-batch: its own without `step_counts`, the window's on a window's first micro-batch,
    none after that. The learner sums them in the same collective that checks the loss is
    finite on every rank, then `scales` turns the sums into this micro-batch's scales.
    """

    def __init__(self) -> None:
        self.window_totals: dict[str, float] | None = None
        self.window_seen: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.per_call = True

    def reset(self) -> None:
        self.window_totals = None

    def begin(
        self,
        counts: dict[str, float],
        step_counts: Mapping[str, float] | None,
        position: int,
        accumulation: int,
    ) -> dict[str, float] | None:
        """The local counts to sum over ranks before this micro-batch's backward, or None."""
        self.counts = counts
        self.per_call = step_counts is None
        if step_counts is None:
            self.window_totals = None
            return dict(counts)
        local = check_counts(step_counts)
        pending = None
        if position == 0 or self.window_totals is None:
            self.window_totals = None
            self.window_seen = dict.fromkeys(local, 0.0)
            pending = local
        for kind, count in counts.items():
            self.window_seen[kind] += count
        if position == accumulation - 1 and self.window_seen != local:
            seen = self.window_seen
            self.window_totals = None
            raise ValueError(
                f"step_counts {local} do not describe the micro-batches of this window, "
                f"which held {seen}: pass every micro-batch of a window the same "
                "step_counts(micro_batches), computed from all of them"
            )
        return pending

    def scales(
        self, summed: dict[str, float] | None, data_parallel_size: int, accumulation: int
    ) -> dict[str, float]:
        """Each count kind's loss scale, given what `begin` asked to sum (summed over ranks)."""
        if self.per_call:
            totals = {k: v * accumulation for k, v in (summed or {}).items()}
        else:
            if summed is not None:
                self.window_totals = summed
            totals = self.window_totals or {}
        size = data_parallel_size * accumulation
        return {
            k: size * self.counts[k] / totals[k] if totals.get(k, 0) > 0 else 0.0
            for k in self.counts
        }


@dataclass
class MetricTerms:
    """One micro-batch's scalar loss terms and diagnostics, still on the device."""

    keys: list[str] = field(default_factory=list)
    stacked: torch.Tensor | None = None

    def values(self) -> dict[str, float]:
        """As floats: one host synchronization for all of them."""
        if self.stacked is None:
            return {}
        return dict(zip(self.keys, self.stacked.tolist(), strict=True))


def metric_terms(out: Mapping[str, Any]) -> MetricTerms:
    """The floating-point tensors of a loss output (as a dict), each reduced to a scalar, in
    one tensor."""
    keys = [
        k
        for k, v in out.items()
        if isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
    ]
    if not keys:
        return MetricTerms()
    with torch.no_grad():  # one detached stack, not a detach per term
        values = (out[k] for k in keys)
        scalars = [
            v if v.dim() == 0 else v.reshape(()) if v.numel() == 1 else v.mean() for v in values
        ]
        return MetricTerms(keys, torch.stack(scalars).float())


class WindowMetrics:
    """The metrics of an accumulation window so far, over data-parallel ranks.

    Each term is weighted by its own count (a loss term like the loss normalizes it, a
    diagnostic by trained tokens); on the call that closes the window the loss terms are
    exactly the step's global loss terms. A term named `*_max` is the largest value instead.
    `result` costs one all-reduce; `add` none. In a world of several processes the terms ride
    instead on the collective the learner runs before backward anyway (`payload`, then
    `add_summed`), and `result` needs none: on two processes sharing two CPU cores that extra
    all-reduce after the optimizer step was 5-10% of a small model's step.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.summed = False  # sums, weights and maxima already over ranks (add_summed)

    def add(
        self, terms: Mapping[str, float], counts: Mapping[str, float], loss_module: nn.Module
    ) -> None:
        """One micro-batch's terms, weighted by its counts (no collective)."""
        for key, value in terms.items():
            if key.endswith(MAX_SUFFIX):  # a maximum over no trained token says nothing
                self._top(key, value if counts[TOKENS] > 0 else -math.inf)
            else:
                weight = counts[term_kind(loss_module, key)]
                self._accumulate(key, weight * value, weight)

    def _accumulate(self, key: str, weighted: float, weight: float) -> None:
        """A mean term's weighted value and its weight; a term over nothing (no trained
        token) says nothing, but its key is reported."""
        self.sums.setdefault(key, 0.0)
        self.weights.setdefault(key, 0.0)
        if weight > 0:
            self.sums[key] += weighted
            self.weights[key] += weight

    def _top(self, key: str, value: float) -> None:
        """A `*_max` term's value (-inf: none)."""
        self.maxima[key] = max(self.maxima.get(key, -math.inf), value)

    @staticmethod
    def payload(
        terms: MetricTerms,
        counts: Mapping[str, float],
        loss_module: nn.Module,
        slots: int,
        slot: int,
    ) -> torch.Tensor:
        """One micro-batch's terms as `add` weighs them, on the device, to be summed over ranks:
        `[weight * value, weight]` per term, then each `*_max` term in this rank's `slot` of
        `slots` (zeros in the others', so that the sum holds every rank's value)."""
        if terms.stacked is None:
            return torch.zeros(0, dtype=torch.float64)
        values = terms.stacked.double()
        is_max = [key.endswith(MAX_SUFFIX) for key in terms.keys]
        weights = [
            0.0 if top else counts[term_kind(loss_module, key)]
            for key, top in zip(terms.keys, is_max, strict=True)
        ]
        weight = torch.tensor(weights, dtype=torch.float64).to(values.device, non_blocking=True)
        weighted = torch.where(weight > 0, values * weight, 0.0)  # a term over nothing: skipped
        tops = [i for i, top in enumerate(is_max) if top]
        maxima = values.new_zeros(slots, len(tops))
        if tops:  # a maximum over no trained token says nothing
            maxima[slot] = values[tops] if counts[TOKENS] > 0 else -math.inf
        return torch.cat([weighted, weight, maxima.flatten()])

    def add_summed(
        self, keys: list[str], summed: list[float], slots: int, dropped: bool = False
    ) -> None:
        """`payload` summed over ranks (the floats, in its order) for the terms `keys`.
        `dropped`: the window was dropped for a non-finite loss, whose terms then read NaN."""
        count = len(keys)
        weighted, weights, maxima = summed[:count], summed[count : 2 * count], summed[2 * count :]
        tops = [key for key in keys if key.endswith(MAX_SUFFIX)]
        for i, key in enumerate(keys):
            if key not in tops:
                poisoned = dropped and key.startswith("loss")
                self._accumulate(key, math.nan if poisoned else weighted[i], weights[i])
        for j, key in enumerate(tops):
            self._top(key, max(maxima[s * len(tops) + j] for s in range(slots)))
        self.summed = True

    def result(
        self,
        reduce: Callable[
            [dict[str, float], dict[str, float]], tuple[dict[str, float], dict[str, float]]
        ],
    ) -> dict[str, float]:
        """The window so far over data-parallel ranks: `reduce(sums, maxima)` is one collective."""
        keys = sorted(self.sums)
        local = {
            **{f"sum/{k}": self.sums[k] for k in keys},
            **{f"weight/{k}": self.weights[k] for k in keys},
        }
        if self.summed:
            total, largest = local, dict(self.maxima)
        else:
            total, largest = reduce(local, dict(self.maxima))
        means = {
            k: total[f"sum/{k}"] / total[f"weight/{k}"] if total[f"weight/{k}"] > 0 else 0.0
            for k in keys
        }
        means.update((k, v if math.isfinite(v) else 0.0) for k, v in largest.items())
        return means


def sums_and_maxima_over(
    group: dist.ProcessGroup | None,
    device: torch.device,
    sums: Mapping[str, float],
    maxima: Mapping[str, float] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """`sums` summed and `maxima` maximized over `group`'s ranks, in one all-reduce.

    Each rank writes its maxima into a slot of its own, zeros elsewhere; the summed slots hold
    every rank's maxima, maximized locally. A no-op without a group (no data parallelism).
    """
    maxima = maxima or {}
    if group is None:
        return dict(sums), dict(maxima)
    size, here = dist.get_world_size(group), dist.get_rank(group)
    slots = torch.zeros(size, len(maxima), dtype=torch.float64)
    slots[here] = torch.tensor(list(maxima.values()), dtype=torch.float64)
    local = torch.cat([torch.tensor(list(sums.values()), dtype=torch.float64), slots.flatten()])
    local = local.to(device)
    dist.all_reduce(local, group=group)
    values = local.tolist()
    summed = dict(zip(sums, values[: len(sums)], strict=True))
    columns = torch.tensor(values[len(sums) :], dtype=torch.float64).view(size, len(maxima))
    largest = dict(zip(maxima, columns.max(0).values.tolist(), strict=True))
    return summed, largest
