"""`[loss] name = "gspo"`: Group Sequence Policy Optimization (Zheng et al., 2025, arXiv
2507.18071), over TorchRL's `GRPOLoss`, which has no sequence-level ratio.

GSPO clips the ratio of a whole response, s_i = exp(mean over its tokens of (log pi - log mu)),
the length-normalized sequence likelihood ratio (eq. 7), and averages over sequences (eq. 5):

    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

with the paper's bounds eps_low = 3e-4, eps_high = 4e-4 (the defaults here). GSPO-token (eq.
13), `[loss] gspo_token = true`, gives each token the ratio s_i,t = sg(s_i) pi_t / sg(pi_t):
the value of s_i, the gradient of its own log-prob, so that per-token advantages could differ.

Built from TorchRL's pieces: each trained token of row i carries the row's ratio (its log,
`sequence_log_weight`), GRPO's clipped objective is taken per token as usual, and the default
aggregation `prompt_mean` (the mean over rows of each row's token mean) averages each row's
equal terms into its one sequence term: exactly eq. 5, values and gradients
(`tests/unit/test_gspo.py` checks it against the paper's formula written out by hand).

Overridden: `_get_cur_log_prob` (records the trained-token mask it needs) and
`_compute_policy_objective`; `tests/unit/test_gspo.py` fails when their TorchRL signatures
change.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.objectives.llm import GRPOLoss

from titan_learner.learner.batch import trained_mask

GSPO_CLIP_EPSILON = (3e-4, 4e-4)
"""The paper's clipping range, left and right (section 5.1)."""


class GSPOLoss(GRPOLoss):
    """GRPO's clipped objective on the sequence-level ratio s_i (or GSPO-token's s_i,t)."""

    response_mask: torch.Tensor | None = None  # the forward's trained tokens `[B, T]`

    def __init__(
        self,
        actor_network: Any = None,
        *,
        clip_epsilon: float | tuple[float, float] = GSPO_CLIP_EPSILON,
        aggregation: str = "prompt_mean",
        gspo_token: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            actor_network, clip_epsilon=clip_epsilon, aggregation=aggregation, **kwargs
        )
        self.gspo_token = gspo_token

    def _get_cur_log_prob(self, tensordict: Any) -> tuple[Any, Any, Any]:
        log_prob, dist, is_composite = super()._get_cur_log_prob(tensordict)
        behaviour = tensordict.get(
            self.tensor_keys.sample_log_prob,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=0.0,
        )
        # the mask TorchRL's `_log_weight` trains (response tokens with a finite behaviour
        # log-prob), kept in the instance's __dict__ as `losses.forward_values` is
        vars(self)["response_mask"] = trained_mask(dist.mask, behaviour)
        return log_prob, dist, is_composite

    def sequence_log_weight(self, log_weight: torch.Tensor) -> torch.Tensor:
        """log s_i on each trained token of row i (0 elsewhere), `[B, T, 1]` like `log_weight`
        (the token log-ratios, 0 off the trained tokens), with its gradient."""
        mask = self.response_mask
        if mask is None:
            raise RuntimeError(
                "GSPOLoss's objective needs the forward's trained-token mask: call the loss "
                "module, not _compute_policy_objective alone"
            )
        tokens = mask.sum(-1, keepdim=True).clamp_min(1).unsqueeze(-1)  # [B, 1, 1]
        mean = log_weight.sum(dim=-2, keepdim=True) / tokens
        return torch.where(mask.unsqueeze(-1), mean, 0.0)

    def ratio_log_weight(self, log_weight: torch.Tensor) -> torch.Tensor:
        """The log-ratio the objective clips, for the clip diagnostics (`LeanForward`)."""
        return self.sequence_log_weight(log_weight.detach())

    def _compute_policy_objective(
        self, log_weight: torch.Tensor, advantage: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.sequence_log_weight(log_weight)
        if self.gspo_token:  # sg(s_i) pi_t / sg(pi_t): off the mask both terms are 0
            sequence = sequence.detach() + log_weight - log_weight.detach()
        return super()._compute_policy_objective(sequence, advantage)


# TorchRL's loss metaclass wraps the forward of every class it makes again: the subclass keeps
# GRPOLoss's, unchanged.
GSPOLoss.forward = GRPOLoss.forward
