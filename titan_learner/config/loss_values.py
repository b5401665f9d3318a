"""The values each [loss] key may take: one table, checked before any compute.

TorchRL 0.14.1's GRPO-family losses (GRPOLoss, DAPO, CISPOLoss) check few of their keyword
arguments: an `aggregation` they do not know trains `token_mean`, `reduction = "sum"` is
ignored (the terms are means), and `gamma` and `clip_value` are taken and never read. A name
from another library (verl's "seq-mean-token-sum", "token-mean" with a hyphen) would then train
another objective without a word. So every [loss] key, TorchRL's and this project's own, is
described here as a schema field is (a type hint and limits, `config.tables`), and a value
outside it is refused with the values allowed. The learner's normalization across
micro-batches and ranks (`titan_learner.learner.loss.normalization`) implements exactly the
aggregations listed; tests hold the table to TorchRL's signature and behaviour.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_learner.config.errors import ConfigError
from titan_learner.config.tables import check_value


@dataclass(frozen=True)
class LossKey:
    """What one [loss] key accepts: a type hint and limits as a schema field's, the values
    TorchRL takes that the learner refuses, each with the reason, and another library's
    spelling of an allowed value, refused with ours (a did-you-mean could suggest another)."""

    kind: Any
    limits: Mapping[str, Any] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    doc: str = ""  # its meaning, for docs/config.md and `check --explain`


AGGREGATIONS = ("token_mean", "prompt_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""`aggregation`, over the step's trained tokens: their mean (verl's "token-mean"); over its
rows, the mean of each row's token mean (verl's "seq-mean-token-mean"), of each row's token sum
("seq-mean-token-sum"), or the sum over tokens divided by rows x [rollout] max_new_tokens (Dr.
GRPO's constant normalizer, verl's "seq-mean-token-sum-norm")."""
VERL_AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "prompt_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}
"""verl's `loss_agg_mode` names of the aggregations."""
MASKING_STRATEGIES = ("sft", "rlhf", "generic")
PADDING_SIDES = ("left", "right")
COEFFICIENT = LossKey(float, {"min": 0})


@dataclass
class CorrectionTable:
    """`[loss.correction]`: each trained token weighted by the importance ratio r = pi / mu
    against the behaviour policy mu that sampled it (the batch's log-probs), without gradient.

    level "token": r per token; "sequence": per row, the geometric mean of its tokens' ratios.
    mode "truncate": min(r, high) (TIS; verl rollout_corr's truncate); "mask": r where
    low <= r <= high, 0 elsewhere (IcePop; verl's mask). `low` is mask's alone (default
    1 / high).
    """

    level: Literal["token", "sequence"] = "token"
    """token: a ratio per token; sequence: per row, the geometric mean of its token ratios."""
    mode: Literal["truncate", "mask"] = "truncate"
    """truncate: weight min(r, high) (TIS); mask: r inside [low, high], 0 outside (IcePop)."""
    low: float | None = field(default=None, metadata={"min": 0.0, "max": 1.0})
    """mask only: the lower bound; default 1 / high."""
    high: float = field(default=2.0, metadata={"min": 1.0})
    """The upper bound of the ratio."""


NOT_A_SCALAR = "TorchRL's 'none' leaves a loss per token, not the scalar the learner trains"

PROJECT_DEFAULTS: dict[str, Any] = {"masking_strategy": "rlhf"}
"""Defaults that differ from TorchRL's: "rlhf" masks with an explicit response mask, which is
what the batch format carries (TorchRL's "sft" rule assumes a fixed prompt width)."""

LOSS_KEYS: dict[str, LossKey] = {
    "clip_epsilon": LossKey(  # its ranges: check_clip_epsilon
        float | tuple[float, float],
        doc="The clip range of the importance ratio: eps (1 - eps, 1 + eps) or [low, high] "
        "(1 - low, 1 + high; DAPO's clip-higher); gspo's default is the paper's [3e-4, 4e-4], "
        "on the sequence ratio.",
    ),
    "kl_mask_threshold": LossKey(
        float,
        {"min": 0},
        doc="Leave out of the loss the tokens whose |log pi - log mu| exceeds this (TorchRL's "
        "KL mask against the inference policy); unset: none.",
    ),
    "aggregation": LossKey(
        Literal[AGGREGATIONS],
        refused={"none": NOT_A_SCALAR},
        renamed=VERL_AGGREGATIONS,
        doc="How token terms become the step's loss, exact over ranks and micro-batches: "
        "token_mean (verl's token-mean), prompt_mean (seq-mean-token-mean; gspo's default), "
        "seq_mean_token_sum (seq-mean-token-sum), seq_mean_token_sum_norm (Dr. GRPO's sum over "
        "rows x [rollout] max_new_tokens).",
    ),
    "entropy_bonus": LossKey(
        bool,
        doc="Add -entropy_coeff x the mean token entropy to the loss (entropy is logged "
        "either way).",
    ),
    "samples_mc_entropy": LossKey(
        int, {"min": 1}, doc="Samples of TorchRL's Monte-Carlo entropy estimate."
    ),
    "entropy_coeff": LossKey(float, {"min": 0}, doc="The entropy bonus's coefficient."),
    "reduction": LossKey(
        Literal["mean"],
        refused={
            "none": NOT_A_SCALAR,
            "sum": "TorchRL's GRPO-family losses ignore 'sum' and take means",
        },
        doc="TorchRL's reduction: the learner trains a scalar mean.",
    ),
    "kl_to_ref_coeff": LossKey(
        float,
        {"min": 0},
        doc="[kl] placement = loss: the coefficient of the KL (k3) to the reference policy, a "
        "token mean; a frozen reference copy is held while it is set.",
    ),
    "kl_to_inference_coeff": LossKey(
        float,
        {"min": 0},
        doc="The coefficient of TorchRL's KL to the behaviour (inference) policy, a token mean.",
    ),
    "masking_strategy": LossKey(
        Literal[MASKING_STRATEGIES],
        doc="TorchRL's rule for which tokens are trained; rlhf (ours by default) reads the "
        "batch's response mask.",
    ),
    "ref_log_prob_padding_side": LossKey(
        Literal[PADDING_SIDES], doc="TorchRL's padding side of reference log-probs."
    ),
    "ref_log_prob_padding_value": LossKey(
        float, doc="TorchRL's padding value of reference log-probs."
    ),
    # this project's own (titan_learner.learner.loss.classes, .gspo, .correction, .job.reward_shaping)
    "tis_cap": LossKey(
        float,
        {"min": 1},
        doc="Truncated importance sampling against the behaviour policy: [loss.correction] "
        "level token, mode truncate, high = tis_cap (its older name).",
    ),
    "gspo_token": LossKey(
        bool, doc="gspo only: GSPO-token, each token's ratio sg(s_i) pi_t / sg(pi_t)."
    ),
    "correction": LossKey(CorrectionTable, doc="[loss.correction], below."),
    "mask_truncated": LossKey(
        bool,
        doc="DAPO's overlong filtering: completions cut at max_new_tokens train no token (they "
        "still count in their group's advantage).",
    ),
}
UNREAD_KEYS = ("gamma", "clip_value")
"""Keyword arguments TorchRL's GRPO-family losses take and never read (no value function)."""
CLIP_EPSILON_ALLOWED = (
    "0 < clip_epsilon < 1, or [low, high] with 0 <= low < 1 and high > 0 (finite numbers)"
)


def check_loss_value(key: str, value: Any, source: str) -> None:
    """`value` of [loss] `key` (a key the loss takes) within what the loss implements."""
    where = f"[loss] {key}"
    if key in UNREAD_KEYS:
        raise ConfigError(
            f"TorchRL's GRPO-family losses take {key} but never read it; allowed: leave it out",
            source=source,
            where=where,
        )
    rule = LOSS_KEYS[key]
    ours = rule.renamed.get(value) if isinstance(value, str) else None
    if ours is not None:
        allowed = ", ".join(repr(v) for v in typing.get_args(rule.kind))
        raise ConfigError(
            f"{value!r} is verl's name; here it is {ours!r}; allowed: {allowed}",
            source=source,
            where=where,
        )
    try:
        converted = check_value(value, rule.kind, rule.limits, ("loss", key), source)
    except ConfigError as err:
        why = rule.refused.get(value) if isinstance(value, str) else None
        if why is None:
            raise
        raise ConfigError(f"{err.detail}; {why}", source=source, where=where) from None
    if key == "clip_epsilon":
        check_clip_epsilon(converted, value, source)
    if key == "correction" and converted.mode == "truncate" and converted.low is not None:
        raise ConfigError(
            f"low = {converted.low} bounds the ratios mode = 'mask' keeps; 'truncate' caps "
            "the ratio from above only (min(r, high)); allowed: leave low out, or mode = 'mask'",
            source=source,
            where="[loss.correction] low",
        )


def correction_table(kwargs: Mapping[str, Any], source: str) -> CorrectionTable | None:
    """The [loss] correction a config asks for: `[loss.correction]`, or its alias `tis_cap = C`
    (level "token", mode "truncate", high C); None without either."""
    table, cap = kwargs.get("correction"), kwargs.get("tis_cap")
    if table is not None and cap is not None:
        raise ConfigError(
            "tis_cap = C is [loss.correction] level = 'token', mode = 'truncate', high = C; "
            "allowed: one of them",
            source=source,
            where="[loss] tis_cap",
        )
    if cap is not None:
        return CorrectionTable(high=float(cap))
    if table is None:
        return None
    return check_value(table, CorrectionTable, {}, ("loss", "correction"), source)


def check_clip_epsilon(bounds: float | tuple[float, float], value: Any, source: str) -> None:
    """A number x clips the ratio to [1 - x, 1 + x]; [low, high] to [1 - low, 1 + high]."""
    low, high = bounds if isinstance(bounds, tuple) else (bounds, bounds)
    finite = math.isfinite(low) and math.isfinite(high)
    if not (finite and 0 <= low < 1 and high > 0):
        raise ConfigError(
            f"{value!r} is out of range; allowed: {CLIP_EPSILON_ALLOWED}",
            source=source,
            where="[loss] clip_epsilon",
        )
