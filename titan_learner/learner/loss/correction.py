"""`[loss.correction]`: off-policy correction against the behaviour policy that sampled the batch.

The batch's log-probs are the behaviour policy mu's: the generator's (vLLM's kernels, the
embedded model's) from weights up to `[rollout] max_off_policy_steps` versions old. With a
correction, the loss's own objective is taken on the current policy (the ratio
pi_theta / sg(pi_theta), 1 in value, the gradient of log pi_theta) and each trained token is
weighted, without gradient, by w = f(r), r = pi_theta / mu at the forward: until the step's
optimizer update the learner holds the weights that sampled the batch (pi_old), so r is the
pi_old / mu of verl's decoupled rollout correction.

- level "token": r per token; "sequence": per row, exp(mean of its tokens' log r), the
  geometric mean of the token ratios, on each of its tokens;
- mode "truncate": w = min(r, high): truncated importance sampling (TIS, Yao et al., 2025;
  verl rollout_corr "truncate"); `[loss] tis_cap = C` is level "token", high C;
- mode "mask": w = r inside [low, high], 0 outside: IcePop (token level; Ling team, 2025)
  and verl's "mask" (sequence level: its "geo_mean" ratio).

Every loss takes it the same way, its objective at ratio 1 times sg(w) per token: CISPO
-w A log pi (its clipped weight is 1), GSPO -w A s with s = pi / sg(pi) over the row (at token
level each token's w weighs its row's sequence gradient: the row's mean w, in effect); both
levels make sense for each (tests/unit/test_correction.py checks them by hand).

The loss output reports, as means over the trained tokens, `correction/truncated_fraction`
and `correction/masked_fraction` (the share of tokens whose weight the bounds cut or zeroed),
`correction/ratio_mean`, and the largest ratio `correction/ratio_max`; with `tis_cap`, also
its former name `tis_truncated`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from titan_learner.config.loss_values import CorrectionTable

CORRECTION_METRICS = (
    "correction/truncated_fraction",
    "correction/masked_fraction",
    "correction/ratio_mean",
    "correction/ratio_max",
)


@dataclass(frozen=True)
class Correction:
    """What `[loss.correction]` (or `tis_cap`) asks for, checked (config.loss_values)."""

    level: str
    mode: str
    low: float
    high: float
    alias: bool = False  # written as `tis_cap`: reports `tis_truncated` too


def build_correction(table: CorrectionTable | None, alias: bool) -> Correction | None:
    """The checked `[loss.correction]` table (`alias`: written as `tis_cap`) as the loss reads
    it: mask's `low` defaults to 1 / high (verl's), truncate has none (0)."""
    if table is None:
        return None
    low = 0.0
    if table.mode == "mask":
        low = table.low if table.low is not None else 1 / table.high
    return Correction(table.level, table.mode, low, table.high, alias)


class BehaviourCorrection:
    """The loss's objective on the current policy, each token weighted by the correction.

    Reads the trained-token mask and count `TrainedTokens` keeps at the forward; leaves its
    metrics in the forward's values (`correction_metrics`) for `LeanForward.forward` to put in
    the output.
    """

    correction: Correction | None = None

    def _compute_policy_objective(self, log_weight: Any, advantage: Any) -> tuple[Any, Any]:
        correction = self.correction
        if correction is None:
            return super()._compute_policy_objective(log_weight, advantage)  # type: ignore[misc]
        behaviour = log_weight.detach()  # log pi_theta - log mu; 0 off the trained tokens
        mask = self.trained_column  # type: ignore[attr-defined]
        log_ratio = behaviour
        if correction.level == "sequence":
            tokens = mask.sum(-2, keepdim=True).clamp_min(1)
            log_ratio = torch.where(mask, behaviour.sum(-2, keepdim=True) / tokens, 0.0)
        ratio = log_ratio.exp()
        high = log_ratio > math.log(correction.high)
        if correction.mode == "truncate":
            weight, cut = ratio.clamp(max=correction.high), high
            truncated, masked = cut, None
        else:
            low = log_ratio < math.log(correction.low) if correction.low > 0 else None
            cut = high if low is None else high | low
            weight = torch.where(cut, 0.0, ratio)
            truncated, masked = None, cut
        self.record_correction(ratio, mask, truncated, masked)
        loss, clipped = super()._compute_policy_objective(log_weight - behaviour, advantage)  # type: ignore[misc]
        return loss * weight, clipped

    def record_correction(
        self,
        ratio: torch.Tensor,
        mask: torch.Tensor,
        truncated: torch.Tensor | None,
        masked: torch.Tensor | None,
    ) -> None:
        """The correction's metrics, token means over the trained tokens (`mask`)."""
        count = self.trained_count  # type: ignore[attr-defined]
        with torch.no_grad():
            zero = ratio.new_zeros(())

            def share(cut: torch.Tensor | None) -> torch.Tensor:
                return zero if cut is None else (cut & mask).sum().to(ratio.dtype) / count

            on_tokens = torch.where(mask, ratio, 0.0)  # ratios are > 0: the max is a token's
            metrics = {
                "correction/truncated_fraction": share(truncated),
                "correction/masked_fraction": share(masked),
                "correction/ratio_mean": on_tokens.sum() / count,
                "correction/ratio_max": on_tokens.amax() if on_tokens.numel() else zero,
            }
            if self.correction.alias:  # type: ignore[union-attr]
                metrics["tis_truncated"] = metrics["correction/truncated_fraction"]
        vars(self).setdefault("forward_values", {})["correction_metrics"] = metrics
