"""The loss classes the learner builds: one subclass of its TorchRL class per `[loss] name`.

Each class is TorchRL's (or, where TorchRL's departs from the paper or has none, the published
objective's: `cispo.MiniMaxCISPOLoss`, `gspo.GSPOLoss`) with the learner's helpers
(titan_learner.learner.loss.losses) in front of it, and its docstring lists the TorchRL methods
the class overrides. tests/unit/test_torchrl_overrides.py checks each list against the class's
MRO and pins those methods' TorchRL 0.14.1 signatures: an upgrade that changes one fails there,
naming it. The class keeps its TorchRL name (error messages name it like TorchRL's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrl.objectives.llm import grpo

from titan_learner.config.errors import ConfigError
from titan_learner.config.loss_values import PROJECT_DEFAULTS, correction_table
from titan_learner.config.validate import loss_class
from titan_learner.learner.loss import cispo, gspo
from titan_learner.learner.loss.aggregation import RowSumAggregation
from titan_learner.learner.loss.correction import BehaviourCorrection, build_correction
from titan_learner.learner.loss.losses import (
    CachedClipBounds,
    ChunkedEntropy,
    LeanForward,
    LogProbMismatch,
    MaskedLogWeight,
    ReferenceKLEstimator,
    TokenMeanAggregation,
    TokenMeanDiagnostics,
    TokenMeanKL,
    TrainedTokens,
)

if TYPE_CHECKING:
    from torch import nn

    from titan_learner.config.schema import LossSection

HELPERS = (
    LeanForward,
    TokenMeanKL,
    ReferenceKLEstimator,
    LogProbMismatch,
    TokenMeanDiagnostics,
    BehaviourCorrection,
    TokenMeanAggregation,
    RowSumAggregation,
    TrainedTokens,  # the others read its mask and count
    MaskedLogWeight,  # innermost, in place of TorchRL's own helpers
    ChunkedEntropy,
    CachedClipBounds,
)
"""The learner's helpers, outermost first, in front of every TorchRL class."""


class GRPOLoss(*HELPERS, grpo.GRPOLoss):
    """`[loss] name = "grpo"`: TorchRL's GRPOLoss.

    Overrides: `forward`, `_log_weight`, `_kl_to_ref`, `_get_entropy`, `_clip_bounds`,
    `_aggregate_loss_value`, `_compute_policy_objective`.
    """


class DAPO(*HELPERS, grpo.DAPO):
    """`[loss] name = "dapo"`: TorchRL's DAPO.

    Overrides: `forward`, `_log_weight`, `_kl_to_ref`, `_get_entropy`, `_clip_bounds`,
    `_aggregate_loss_value`, `_compute_policy_objective`.
    """


class CISPOLoss(*HELPERS, grpo.CISPOLoss):
    """TorchRL's CISPOLoss (its objective is not the paper's: `[loss] name = "cispo"` builds
    `MiniMaxCISPOLoss`).

    Overrides: `forward`, `_log_weight`, `_kl_to_ref`, `_get_entropy`, `_clip_bounds`,
    `_aggregate_loss_value`, `_compute_policy_objective`.
    """


class MiniMaxCISPOLoss(*HELPERS, cispo.MiniMaxCISPOLoss):
    """`[loss] name = "cispo"`: CISPO as MiniMax-M1 defines it, over TorchRL's CISPOLoss.

    Overrides: `__init__`, `forward`, `_log_weight`, `_kl_to_ref`, `_get_entropy`,
    `_clip_bounds`, `_aggregate_loss_value`, `_compute_policy_objective`, `_get_cur_log_prob`.
    """


class GSPOLoss(*HELPERS, gspo.GSPOLoss):
    """`[loss] name = "gspo"`: GSPO's sequence-level ratio, over TorchRL's GRPOLoss.

    Overrides: `__init__`, `forward`, `_log_weight`, `_kl_to_ref`, `_get_entropy`,
    `_clip_bounds`, `_aggregate_loss_value`, `_compute_policy_objective`, `_get_cur_log_prob`.
    """


BUILT: dict[type, type] = {
    grpo.GRPOLoss: GRPOLoss,
    grpo.DAPO: DAPO,
    grpo.CISPOLoss: CISPOLoss,
    cispo.MiniMaxCISPOLoss: MiniMaxCISPOLoss,
    gspo.GSPOLoss: GSPOLoss,
}
"""The class over which each of ours is built -> ours."""

for _base, _ours in BUILT.items():
    # TorchRL's loss metaclass wraps the forward of every class it makes (exploration and
    # recurrent modes around each call): ours is `LeanForward`'s unwrapped, and its fallback
    # the base's own, which enters both modes once per call.
    _ours.forward = LeanForward.forward
    _ours._torchrl_forward = _base.forward

PUBLISHED_OBJECTIVES: dict[str, type] = {
    "cispo": cispo.MiniMaxCISPOLoss,
    "gspo": gspo.GSPOLoss,
}
"""Where TorchRL's class is not the published algorithm (or TorchRL has none), the subclass
that is (by [loss] name)."""


def titan_loss_class(cls: type) -> type:
    """Ours over `cls` (a TorchRL GRPO-family loss or a published objective)."""
    if cls not in BUILT:
        allowed = ", ".join(base.__name__ for base in BUILT)
        raise ValueError(f"no loss class of ours over {cls.__name__}; allowed: {allowed}")
    return BUILT[cls]


def build_loss(
    section: LossSection,
    actor: nn.Module,
    *,
    max_new_tokens: int | None = None,
    kl_estimator: str | None = None,
) -> nn.Module:
    """Instantiate the TorchRL loss over `actor` with the configured keyword arguments;
    `max_new_tokens` ([rollout]) is `seq_mean_token_sum_norm`'s constant, `kl_estimator`
    ([kl] estimator with placement = "loss") the reference KL's per-token estimate."""
    kwargs = {**PROJECT_DEFAULTS, **section.kwargs}
    if isinstance(kwargs.get("clip_epsilon"), list):
        kwargs["clip_epsilon"] = tuple(kwargs["clip_epsilon"])
    correction = build_correction(correction_table(kwargs, "[loss]"), "tis_cap" in kwargs)
    kwargs.pop("correction", None)
    kwargs.pop("tis_cap", None)
    kwargs.pop("mask_truncated", None)  # the job's: it leaves truncated rows out of the batch
    try:
        base = PUBLISHED_OBJECTIVES.get(section.name) or loss_class(section.name)
        loss = titan_loss_class(base)(actor, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build loss '{section.name}': {err}", where="[loss]") from err
    loss.max_new_tokens = max_new_tokens
    loss.kl_estimator = kl_estimator
    loss.correction = correction
    return loss
