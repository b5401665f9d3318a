"""`[loss] name = "cispo"`: CISPO as MiniMax-M1 defines it, over TorchRL's `CISPOLoss`.

TorchRL 0.14.1's `CISPOLoss._compute_policy_objective` is -exp(clamp(log_weight)) * A: the clamp
has no gradient outside its bounds, so a token whose weight is clipped gets no gradient at all,
which is GRPO's clipping with another objective. CISPO's point is the opposite (MiniMax-M1,
arXiv 2506.13585, eq. 4): the clipped weight is a constant and every token keeps the gradient of
its log-prob. Reproduction, three tokens with log-ratios 0, 0.5, -0.5, advantages 1, 1, -1 and
clip_epsilon (0.2, 0.28), the gradient of the summed loss with respect to log pi::

    loss = CISPOLoss(clip_epsilon=(0.2, 0.28))
    log_weight = torch.tensor([[0.0], [0.5], [-0.5]], requires_grad=True)
    objective, _ = loss._compute_policy_objective(log_weight, torch.tensor([[1.0], [1.0], [-1.0]]))
    torch.autograd.grad(objective.sum(), log_weight)  # TorchRL 0.14.1: [-1, 0, 0]
                                                      # the paper:      [-1, -1.28, 0.8]

`MiniMaxCISPOLoss` overrides that one method (and records the current log-prob it needs);
`tests/unit/test_cispo.py` runs the reproduction on TorchRL's class and fails once TorchRL
changes it, so that this subclass can go.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.objectives.llm import CISPOLoss


class MiniMaxCISPOLoss(CISPOLoss):
    """CISPO's per-token loss -sg(w_hat) * A * log pi, with w_hat = min(r, 1 + eps_high).

    r = pi / mu is the importance ratio against the batch's (behaviour) log-probs, and sg the
    stop-gradient: every trained token keeps the gradient of its log-prob, scaled by its
    clipped weight, whichever side of the bounds it lies on and whatever the advantage's sign.
    The paper clips from above only ("we did not impose a lower bound"): a number
    `clip_epsilon = e` (TorchRL's default 0.2) bounds the weight by 1 + e; a pair
    `clip_epsilon = [low, high]` also keeps the lower bound, w_hat = clip(r, 1 - low, 1 + high).
    The terms are aggregated like any other loss's (token mean by default). `clip_fraction` is
    the share of tokens whose weight the bounds changed.
    """

    current_log_prob: torch.Tensor | None = None  # the forward's log pi, until the objective

    def __init__(
        self,
        actor_network: Any = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(actor_network, clip_epsilon=clip_epsilon, **kwargs)
        self.clips_below = isinstance(clip_epsilon, tuple | list)

    def _get_cur_log_prob(self, tensordict: Any) -> tuple[Any, Any, Any]:
        log_prob, dist, is_composite = super()._get_cur_log_prob(tensordict)
        # Kept for the objective (0 off the distribution's mask, as both of the policy's
        # distributions give it); set in the instance's __dict__ (no
        # nn.Module.__setattr__), as `losses.forward_values` is.
        vars(self)["current_log_prob"] = log_prob
        return log_prob, dist, is_composite

    def _compute_policy_objective(
        self, log_weight: torch.Tensor, advantage: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_prob = vars(self).pop("current_log_prob", None)
        if log_prob is None:
            raise RuntimeError(
                "MiniMaxCISPOLoss's objective needs the forward's log-probs: call the loss "
                "module, not _compute_policy_objective alone"
            )
        low, high = self._clip_bounds
        log_ratio = log_weight.detach()
        clipped = log_ratio.clamp(low if self.clips_below else None, high)
        clip_fraction = (clipped != log_ratio).to(log_weight.dtype).mean()
        # log pi in value; its gradient through the log-weight the caller passes (the same as
        # log pi's: the behaviour log-prob is a constant; `BehaviourCorrection` passes
        # the log-weight less its value, so that the weight is its own)
        log_pi = log_weight + (log_prob.unsqueeze(-1) - log_weight).detach()
        return -clipped.exp() * advantage * log_pi, clip_fraction


# TorchRL's loss metaclass wraps the forward of every class it makes again (CISPOLoss's is
# GRPOLoss's wrapped twice already): the subclass keeps CISPOLoss's, unchanged.
MiniMaxCISPOLoss.forward = CISPOLoss.forward
