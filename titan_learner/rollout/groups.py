"""Some groups of a rollout, and rollouts joined into one: the batch dynamic sampling keeps.

A group is the G consecutive rows that answer one prompt (rollout.base); keeping or joining
whole groups keeps that layout, so the group advantage reads the result like any rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titan_learner.rollout.base import Rollout


def group_rows(groups: Sequence[int], group_size: int) -> torch.Tensor:
    """`[len(groups) * group_size]` int64: the rows of `groups`, in their order."""
    starts = torch.as_tensor(list(groups), dtype=torch.int64) * group_size
    return (starts.unsqueeze(1) + torch.arange(group_size)).reshape(-1)


def select_groups(rollout: Rollout, groups: Sequence[int]) -> Rollout:
    """The rollout of `groups` only (prompt indices, in the order given)."""
    rows = group_rows(groups, rollout.group_size)
    return Rollout(
        prompts=[rollout.prompts[g] for g in groups],
        group_size=rollout.group_size,
        completion_tokens=rollout.completion_tokens[rows],
        completion_log_probs=rollout.completion_log_probs[rows],
        completion_lengths=rollout.completion_lengths[rows],
        finished=rollout.finished[rows],
        pad_id=rollout.pad_id,
        weights_version=rollout.weights_version,
        completion_mask=None if rollout.completion_mask is None else rollout.completion_mask[rows],
    )


def join_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """One rollout of every group of `rollouts`, in order; completions padded to the widest
    (tokens with `pad_id`, log-probs with NaN, as a generator pads them; a multi-turn
    rollout's `completion_mask` with False: padding is not trained)."""
    first = rollouts[0]
    width = max(r.completion_tokens.shape[1] for r in rollouts)

    def padded(tensor: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)

    return Rollout(
        prompts=[prompt for r in rollouts for prompt in r.prompts],
        group_size=first.group_size,
        completion_tokens=torch.cat([padded(r.completion_tokens, r.pad_id) for r in rollouts]),
        completion_log_probs=torch.cat(
            [padded(r.completion_log_probs, torch.nan) for r in rollouts]
        ),
        completion_lengths=torch.cat([r.completion_lengths for r in rollouts]),
        finished=torch.cat([r.finished for r in rollouts]),
        pad_id=first.pad_id,
        weights_version=first.weights_version,
        completion_mask=None
        if first.completion_mask is None
        else torch.cat([padded(r.completion_mask, False) for r in rollouts]),
    )
