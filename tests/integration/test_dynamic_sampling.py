"""`[rollout] dynamic_sampling`: DAPO's batch of groups with unequal rewards, sampled round by
round; every rank agrees on the rounds and a resumed run repeats the uninterrupted one.

The rounds' logic is checked on rollouts of chosen rewards (ragged completions, groups kept,
dropped and filled); the job on the toy with 2 gloo ranks, whose groups of 4 completions often
all score alike.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.integration.test_train import TOY, interrupted_and_whole, training_lines
from tests.support.worlds import run_world
from titan_learner.config.toml import load_config
from titan_learner.data.loader import Prompt, PromptLoader
from titan_learner.job.dynamic_sampling import DynamicSamplingRollouts, equal_reward_groups
from titan_learner.job.sampled import Sampled
from titan_learner.rewards.runner import Scores
from titan_learner.rollout.base import rollout_from_lists
from titan_learner.rollout.groups import join_rollouts, select_groups

G = 4
EOS, PAD = 13, 10
DYNAMIC = ["rollout.dynamic_sampling=true", "rollout.group_size=4", "eval.every_steps=0"]


def prompts(n: int) -> list[Prompt]:
    return [
        Prompt([11, i % 10, (i * 7) % 10, 12], str(i), {"answer": ""}, f"f:{i}") for i in range(n)
    ]


def rollout_of(mine: list[Prompt], seed: int):
    """G completions of 1..6 tokens per prompt, some ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    completions, log_probs = [], []
    for _ in range(len(mine) * G):
        n = int(torch.randint(1, 7, (1,), generator=g))
        ids = torch.randint(0, 10, (n,), generator=g).tolist()
        ids[-1] = EOS if n % 2 else ids[-1]
        completions.append(ids)
        log_probs.append((-torch.rand(n, generator=g)).tolist())
    return rollout_from_lists([p.ids for p in mine], G, completions, log_probs, EOS, PAD, 0)


def rounds_of(rewards_per_round: list[list[float]], max_rounds: int):
    """A DynamicSamplingRollouts on one rank whose round r scores `rewards_per_round[r]`."""
    config = load_config(
        TOY,
        [*DYNAMIC, "rollout.prompts_per_step=3", f"rollout.max_sampling_rounds={max_rounds}"],
    )
    learner = SimpleNamespace(
        capabilities=SimpleNamespace(data_parallel_size=1),
        data_parallel_group=None,
        device=torch.device("cpu"),
    )
    loader = PromptLoader(prompts(12), 3, seed=0)

    def sample(mine, step, attempt):
        return Sampled(rollout_of(mine, 100 * step + attempt), mine, 0.1)

    calls: list[Sampled] = []

    def score(sampled):
        total = torch.tensor(rewards_per_round[len(calls)])
        calls.append(sampled)
        rows = len(total)
        return [f"t{i}" for i in range(rows)], [None] * rows, Scores(total, {"r": total}, 0)

    return DynamicSamplingRollouts(config, learner, None, loader, sample, score), loader


def test_equal_reward_groups():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0])
    assert equal_reward_groups(rewards, G).tolist() == [True, False, True]


def test_select_and_join_keep_whole_groups_and_pad_completions():
    first, second = rollout_of(prompts(3), 0), rollout_of(prompts(2), 1)
    picked = select_groups(first, [2, 0])
    assert picked.prompts == [first.prompts[2], first.prompts[0]]
    assert torch.equal(picked.completion_lengths[:G], first.completion_lengths[2 * G : 3 * G])
    joined = join_rollouts([picked, second])
    assert (
        joined.num_sequences == 4 * G
        and joined.completion_ids[G : 2 * G] == first.completion_ids[:G]
    )
    assert joined.completion_ids[2 * G :] == second.completion_ids


def with_turn_mask(rollout, seed: int):
    """The rollout as a multi-turn one: a random trained mask inside each completion."""
    g = torch.Generator().manual_seed(seed)
    inside = torch.arange(rollout.completion_tokens.shape[1]) < rollout.completion_lengths[:, None]
    mask = inside & (torch.rand(inside.shape, generator=g) < 0.6)
    return dataclasses.replace(rollout, completion_mask=mask)


def test_select_and_join_keep_the_trained_mask_of_multi_turn_rollouts():
    """A multi-turn rollout trains its model turns alone (`completion_mask`): picking and
    joining groups keeps each row's mask, and the padding a join adds is not trained."""
    first = with_turn_mask(rollout_of(prompts(3), 0), 1)
    second = with_turn_mask(rollout_of(prompts(2), 1), 2)
    joined = join_rollouts([select_groups(first, [2, 0]), second])
    rows = [*range(2 * G, 3 * G), *range(G)]
    width = joined.completion_mask.shape[1]
    expected = torch.cat(
        [
            torch.nn.functional.pad(
                first.completion_mask[rows], (0, width - first.completion_tokens.shape[1])
            ),
            torch.nn.functional.pad(
                second.completion_mask, (0, width - second.completion_tokens.shape[1])
            ),
        ]
    )
    assert joined.completion_mask.dtype == torch.bool
    assert torch.equal(joined.completion_mask, expected)
    assert join_rollouts([first]).completion_mask is not None
    assert join_rollouts([rollout_of(prompts(1), 3)]).completion_mask is None


def test_rounds_go_on_until_the_share_is_full_then_surplus_is_left_out():
    useful, flat = [0.0, 1.0, 0.5, 0.5], [1.0] * G
    rollouts, loader = rounds_of([[*flat, *useful, *flat], [*useful, *useful, *useful]], 5)
    taken = rollouts.take(1)
    # round 1 keeps its group 1; round 2 fills the share with its groups 0 and 1
    assert taken.sampled.metrics == {
        "sampling_rounds": 2.0,
        "groups_dropped": 2.0,
        "groups_surplus": 1.0,
    }
    assert loader.position == 6, "two rounds of prompts_per_step = 3"
    again = PromptLoader(prompts(12), 3, seed=0)
    first, second = again.next_step(), again.next_step()
    assert [p.origin for p in taken.sampled.mine] == [
        p.origin for p in (first[1], second[0], second[1])
    ]
    assert taken.sampled.rollout.num_sequences == 3 * G
    assert not equal_reward_groups(taken.sampled.scored[2].total, G).any()


def test_after_the_last_round_a_short_share_is_filled_with_dropped_groups():
    flat = [1.0] * G
    rollouts, loader = rounds_of([[*flat, 0.0, 1.0, 0.0, 1.0, *flat], [*flat, *flat, *flat]], 2)
    taken = rollouts.take(1)
    # 1 useful group, 2 of the 5 dropped fill the share: 3 left out
    assert taken.sampled.metrics == {
        "sampling_rounds": 2.0,
        "groups_dropped": 3.0,
        "groups_surplus": 0.0,
    }
    assert taken.sampled.rollout.num_sequences == 3 * G and loader.position == 6


@pytest.mark.slow
def test_two_ranks_agree_on_the_rounds_and_resume_exactly(tmp_path):
    overrides = (*DYNAMIC, "parallelism.dp_shard=2")
    rank0, rank1 = run_world(2, interrupted_and_whole, str(tmp_path), overrides, 2)
    whole = rank0["whole"]
    assert max(m["sampling_rounds"] for m in whole) >= 2, "the toy drops groups: more rounds"
    assert all(m["groups_zero_variance_fraction"] == 0 for m in whole if m["sampling_rounds"] < 10)
    for key in ("sampling_rounds", "groups_dropped", "groups_surplus", "reward_mean"):
        assert [m[key] for m in rank1["whole"]] == [m[key] for m in whole], key
    for got, want in zip(rank0["first"] + rank0["resumed"], whole, strict=True):
        for key in ("sampling_rounds", "groups_dropped", "epoch", "reward_mean", "loss_objective"):
            assert got[key] == want[key], key
    assert [line["step"] for line in training_lines(tmp_path / "cut")] == [1, 2, 3, 4]
