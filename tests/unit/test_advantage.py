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


REWARDS = torch.tensor([0.0, 1.0, 0.5, 0.25, 1.0, 1.0, 0.0, 0.0, 0.1, 0.7, 0.2, 0.9])


def test_scale_none_is_the_reward_less_its_group_mean():
    """Dr. GRPO: no division by a std."""
    groups = REWARDS.view(3, 4)
    expected = (groups - groups.mean(1, keepdim=True)).view(-1)
    torch.testing.assert_close(group_advantages(REWARDS, 4, scale="none"), expected)


def test_scale_batch_divides_by_the_std_of_every_ranks_rewards():
    """Two data-parallel ranks of 4 and 8 rows: each divides by the std of all 12 rewards
    (unbiased), so their halves are the one-process advantages."""
    groups = REWARDS.view(3, 4)
    std = math.sqrt(((REWARDS - REWARDS.mean()) ** 2).sum() / 11)
    expected = ((groups - groups.mean(1, keepdim=True)) / (std + 1e-4)).view(-1)
    torch.testing.assert_close(group_advantages(REWARDS, 4, scale="batch"), expected)
    ranks = [REWARDS[:4], REWARDS[4:]]
    split = [group_advantages(r, 4, scale="batch", step_rewards=REWARDS) for r in ranks]
    torch.testing.assert_close(torch.cat(split), expected)


def test_the_default_scale_is_the_group_std_bit_for_bit():
    groups = REWARDS.view(3, 4)
    before = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    assert torch.equal(group_advantages(REWARDS, 4), before.view(-1))
    assert torch.equal(group_advantages(REWARDS, 4, 1e-4, "group"), before.view(-1))


@pytest.mark.parametrize(
    ("advantage", "message"),
    [
        (
            {"scale": "std"},
            "[advantage] scale: 'std' is not allowed; allowed: 'group', 'batch', 'none'",
        ),
        ({"eps": 0.0}, "[advantage] eps: 0.0 is not allowed; allowed: > 0"),
        ({"eps": -1.0}, "[advantage] eps: -1.0 is out of range; allowed: >= 0.0"),
    ],
)
def test_a_bad_advantage_section_is_one_clear_config_error(advantage, message):
    from tests.support.models import tiny_config
    from titan_learner.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        tiny_config(advantage=advantage)
    assert str(err.value) == f"tests: {message}"


def advantages_on_a_rank(rank: int) -> dict[str, list[float]]:
    """Each scale's advantages on a rank of a real gloo world: rank 0 holds the first group's
    rewards, rank 1 the second's."""
    from titan_learner.config.schema import AdvantageSection
    from titan_learner.job.advantage import step_advantages

    mine = REWARDS[:4] if rank == 0 else REWARDS[4:8]
    torch.distributed.init_process_group("gloo")
    group = torch.distributed.new_group([0, 1])  # the data-parallel group: both ranks
    out = {}
    for scale in ("group", "batch", "none"):
        advantages, step_rewards = step_advantages(
            mine,
            4,
            AdvantageSection(scale=scale),
            group,
            torch.device("cpu"),
        )
        assert torch.equal(step_rewards, REWARDS[:8])
        out[scale] = advantages.tolist()
    return out


@pytest.mark.slow
def test_every_scale_on_two_ranks_is_the_one_process_step():
    from tests.support.worlds import run_world

    rank0, rank1 = run_world(2, advantages_on_a_rank)
    for scale in ("group", "batch", "none"):
        expected = group_advantages(REWARDS[:8], 4, scale=scale)
        torch.testing.assert_close(torch.tensor(rank0[scale] + rank1[scale]), expected, msg=scale)
