"""The KL to the reference policy, in the loss or in the reward (`[kl] placement`).

"loss" (the default) is TorchRL's term: `[loss] kl_to_ref_coeff` x the mean over trained
tokens of k3, its gradient through the policy's log-probs; the job only hands the loss the
reference's log-probs. "reward" is verl's `use_kl_in_reward` (InstructGPT's penalty): before
the group advantage, each completion's reward is reduced by `[kl] coeff` x the sum over its
tokens of an estimate of KL(pi || pi_ref), with no gradient of its own. The estimators are
Schulman's (verl's `kl_penalty` names in brackets), from r = log pi(a) - log pi_ref(a) of each
sampled token a:

    k1 = r                      ("kl")
    k2 = r^2 / 2                ("mse")
    k3 = exp(-r) - 1 + r        ("low_var_kl"; clamped to [-10, 10] as verl does)

log pi is the behaviour log-prob the generator returned with the token: the policy that
sampled the batch, which verl recomputes with the trainer's forward instead (the same weights
on-policy, up to the engine's numerical mismatch, training/logprob_mismatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    REF_LOG_PROBS_KEY,
)
from titan_learner.learner.loss.kl_estimators import per_token_kl
from titan_learner.rollout.base import REWARD_KEY

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from titan_learner.config.schema import Config

K3_CLAMP = 10.0
"""verl's `low_var_kl` bound on each token's k3."""


def uses_reference(config: Config) -> bool:
    """Whether the job needs the frozen reference model: a KL in the loss or in the reward."""
    return bool(config.loss.kwargs.get("kl_to_ref_coeff")) or kl_in_reward(config)


def kl_in_reward(config: Config) -> bool:
    return config.kl.placement == "reward" and config.kl.coeff > 0


def reward_estimator(config: Config) -> str:
    """The reward's estimator: `[kl] estimator`, k1 by default (verl's default "kl")."""
    return config.kl.estimator or "k1"


def token_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Each token's estimate of KL(pi || pi_ref) (learner.loss.kl_estimators; k3 clamped)."""
    value = per_token_kl(log_probs.float() - ref_log_probs.float(), estimator)
    return value.clamp(-K3_CLAMP, K3_CLAMP) if estimator == "k3" else value


def sequence_kl(batch: TensorDictBase, estimator: str) -> torch.Tensor:
    """`[N]`: each completion's summed token KL over its response (the batch's assistant
    mask), from the behaviour and the reference log-probs the batch holds."""
    response = batch.get(ASSISTANT_MASK_KEY)
    per_token = token_kl(batch.get(LOG_PROBS_KEY), batch.get(REF_LOG_PROBS_KEY), estimator)
    return torch.where(response, per_token, 0.0).sum(dim=-1)


def penalized(
    batch: TensorDictBase,
    coeff: float,
    estimator: str,
    advantages: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[TensorDictBase, torch.Tensor]:
    """The batch with its advantage taken (`advantages`: the step's `[advantage]`, a
    collective where its scale is the batch's) from the rewards less `coeff` x `sequence_kl`
    (a shallow copy; its "reward" entry stays the scored reward), and that penalty `[N]`."""
    penalty = coeff * sequence_kl(batch, estimator)
    advantage = advantages(batch.get(REWARD_KEY) - penalty)
    out = batch.clone(recurse=False)
    out.set(ADVANTAGE_KEY, advantage.reshape(-1, 1, 1))
    return out, penalty
