"""The rollout metrics a GRPO researcher reads first, on a small case computed by hand."""

from __future__ import annotations

import pytest
import torch

from titan_learner.job.advantage import group_advantages
from titan_learner.job.step_metrics import rollout_metrics


def test_rollout_metrics_of_three_groups_by_hand():
    # group 0 all solved, group 1 split, group 2 none solved: two groups carry no signal
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    advantages = group_advantages(rewards, 2)
    lengths = torch.tensor([3, 8, 5, 8, 1, 7])
    finished = torch.tensor([True, False, True, False, True, True])  # 2 cut at max_new_tokens
    metrics = rollout_metrics(rewards, advantages, lengths, finished, group_size=2)
    a = 0.5 / (0.5**0.5 + 1e-4)  # |r - mean| / (unbiased std + eps) in the split group
    assert metrics == pytest.approx(
        {
            "response_length_mean": 32 / 6,
            "response_length_max": 8.0,
            "response_length_min": 1.0,
            "truncated_fraction": 2 / 6,
            "groups_zero_variance_fraction": 2 / 3,
            "advantage_mean": 0.0,
            "advantage_std": (2 * a * a / 5) ** 0.5,
            "advantage_abs_max": a,
        },
        abs=1e-6,
    )


def test_every_group_with_signal_and_no_truncation():
    rewards = torch.tensor([0.0, 1.0, 0.2, 0.4])
    metrics = rollout_metrics(
        rewards, group_advantages(rewards, 2), torch.tensor([2, 2, 2, 2]), torch.ones(4), 2
    )
    assert metrics["groups_zero_variance_fraction"] == 0.0
    assert metrics["truncated_fraction"] == 0.0
    assert metrics["response_length_min"] == metrics["response_length_max"] == 2.0
