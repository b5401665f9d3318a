"""Group-relative advantages: a hand case, TorchRL's MCAdvantage as a reference, the errors."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantage

from titan_learner.job.advantage import group_advantages


def test_hand_case():
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3])
    adv = group_advantages(rewards, group_size=4, eps=1e-4)
    # group 0: mean 0.5, unbiased std sqrt(0.5 / 3); group 1: all equal -> 0
    std = math.sqrt(0.5 / 3)
    expected = [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert adv.dtype == torch.float32 and adv.shape == (8,)
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)


def test_matches_torchrl_mc_advantage():
    group_size = 4
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0, 0.1, 0.7, 0.2, 0.9])
    n = rewards.numel()
    reference = MCAdvantage(grpo_size=group_size, prompt_key="group_id", trajectory_return="sum")
    trajectories = TensorDict(
        group_id=torch.arange(n // group_size).repeat_interleave(group_size).reshape(n, 1),
        next=TensorDict(
            reward=rewards.reshape(n, 1, 1),
            done=torch.ones(n, 1, 1, dtype=torch.bool),
            batch_size=[n, 1],
        ),
        batch_size=[n, 1],
    )
    expected = reference.inv(trajectories)["advantage"].reshape(n)
    torch.testing.assert_close(group_advantages(rewards, group_size, eps=1e-9), expected)


def test_accepts_a_column_of_rewards():
    rewards = torch.tensor([[1.0], [0.0]])
    torch.testing.assert_close(group_advantages(rewards, 2), group_advantages(rewards[:, 0], 2))


def test_errors():
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="5 rewards do not divide into groups of 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, math.nan]), 2)
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.zeros(2), 2, eps=0.0)
