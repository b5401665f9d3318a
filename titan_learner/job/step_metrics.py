"""What a step's rollout says about the learning signal, over every data-parallel rank's share.

The reward mean alone hides why a GRPO step learns nothing: a group whose completions all got
the same reward (all solved, none solved) has zero advantage everywhere, and completions cut
at `max_new_tokens` score what they never finished. These are computed on the gathered
tensors, the same on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titan_learner.config.schema import Config


def rollout_metrics(
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    lengths: torch.Tensor,
    finished: torch.Tensor,
    group_size: int,
) -> dict[str, float]:
    """Metrics of N completions in groups of `group_size` consecutive rows: rewards,
    advantages and completion lengths `[N]`, `finished` `[N]` (ended with an EOS)."""
    groups = rewards.view(-1, group_size)
    zero_variance = (groups == groups[:, :1]).all(dim=1)
    lengths = lengths.float()
    return {
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "response_length_min": float(lengths.min()),
        "truncated_fraction": float((~finished.bool()).float().mean()),
        "groups_zero_variance_fraction": float(zero_variance.float().mean()),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "advantage_abs_max": float(advantages.abs().max()),
    }


def shaping_metrics(
    config: Config,
    rewards: torch.Tensor,
    shaped: torch.Tensor,
    kl_penalty: torch.Tensor | None,
) -> dict[str, float]:
    """What the job did to the configured rewards `[N]`: DAPO's overlong penalty (added in
    `shaped`) and the KL penalty subtracted with `[kl] placement = "reward"` (None without),
    each a mean per completion, reported only when configured."""
    out = {}
    if config.rollout.overlong_buffer:
        out["overlong_penalty_mean"] = float((shaped - rewards).mean())
    if kl_penalty is not None:
        out["kl_reward_mean"] = float(kl_penalty.mean())
    return out
