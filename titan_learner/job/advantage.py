"""Group-relative advantages for GRPO: A_i = (r_i - mean(group)) / (std(group) + eps).

`[advantage] scale` picks the divisor (TRL's `scale_rewards` names): "group" the group's std
(GRPO, the default), "batch" the std of the step's rewards over every data-parallel rank (the
"group mean, batch std" of Lite PPO and TRL), "none" no division (Dr. GRPO; verl's
`norm_adv_by_std_in_grpo = false`).

A small function, not TorchRL's `torchrl.objectives.llm.MCAdvantage`, although both give the
same numbers (tests/test_advantage.py checks it): MCAdvantage is a replay-buffer *transform* that
queues whole trajectories (TensorDicts with group ids and done flags) until a group is complete,
and holds incomplete groups between calls. Here a rollout always arrives whole, as a flat reward
tensor whose groups are contiguous, so a reshape does the job without that state, and an
incomplete group is an error rather than a silently held queue. The statistics match TorchRL
(and DeepSeekMath's GRPO): the mean and the unbiased (n - 1) std over the group's G rewards.
The one difference is the guard: `std + eps` (the measured recipe, eps=1e-4) instead of
MCAdvantage's `std.clamp_min(1e-6)`; both give 0 to a group whose rewards are all equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titan_learner.job.collectives import gather_over

if TYPE_CHECKING:
    import torch.distributed as dist

    from titan_learner.config.schema import AdvantageSection


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = 1e-4,
    scale: str = "group",
    step_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages `[N]` (float32) for rewards `[N]` in groups of `group_size` rows.

    Rows `g * group_size .. (g + 1) * group_size - 1` are the completions of prompt g (the order
    `Generator.generate` returns them in). `scale = "batch"` divides by the std of
    `step_rewards` (the step's rewards on every data-parallel rank; default: `rewards`).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (a group-relative advantage needs at least two "
            f"completions per prompt), got {group_size!r}"
        )
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps a group of equal rewards at 0), got {eps}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() == 2 and rewards.shape[1] == 1:
        rewards = rewards.squeeze(1)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not divide into groups of {group_size}: "
            f"expected (number of prompts) x {group_size} rewards"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (NaN or inf found)")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.view(-1)
    if scale == "batch":
        std = (rewards if step_rewards is None else torch.as_tensor(step_rewards)).float().std()
    elif scale == "group":
        std = groups.std(dim=1, keepdim=True)
    else:
        raise ValueError(f"scale must be one of 'group', 'batch', 'none', got {scale!r}")
    return (centred / (std + eps)).view(-1)


def step_advantages(
    rewards: torch.Tensor,
    group_size: int,
    section: AdvantageSection,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's advantages as `[advantage]` asks, and the step's rewards over every
    data-parallel rank of `group` (one all-gather, whatever the scale: the std of "batch" is
    theirs, so a rank's advantages are its rows of the one-process step's)."""
    step_rewards = gather_over(rewards, group, device)
    advantages = group_advantages(rewards, group_size, section.eps, section.scale, step_rewards)
    return advantages, step_rewards
