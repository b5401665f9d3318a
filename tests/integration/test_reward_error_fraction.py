"""A reward's `max_error_fraction` is judged over the step's completions on every rank, in a
real 2-process gloo world: one rank's unlucky rows do not stop the job; a reward broken on most
of the step's rows stops every rank with the same line."""

from __future__ import annotations

import pytest

from tests.support.worlds import run_world

pytestmark = pytest.mark.slow


def judge(rank: int) -> dict[str, str | None]:
    import torch.distributed as dist

    from titan_learner.job.scoring import judge_error_fractions
    from titan_learner.rewards.runner import Reward, RewardError, score

    def picky(prompt: str, completion: str, row: dict) -> float:
        return 1.0 if completion == "ok" else "n/a"  # type: ignore[return-value]

    dist.init_process_group("gloo")
    reward = Reward("picky", "rewards.py:picky", picky, 1.0, 5.0, "zero")
    verdicts: dict[str, str | None] = {}
    for case, completions in {
        "3 of 8": [["bad", "bad", "bad", "ok"], ["ok"] * 4],  # rank 0 alone would stop
        "5 of 8": [["bad", "bad", "bad", "ok"], ["ok", "bad", "bad", "ok"]],
    }.items():
        mine = completions[rank]
        origins = [f"train.jsonl:{4 * rank + i + 1}" for i in range(4)]
        scores = score([reward], ["p"] * 4, mine, [{}] * 4, origins)
        try:
            judge_error_fractions([reward], scores)
            verdicts[case] = None
        except RewardError as err:
            verdicts[case] = str(err)
    return verdicts


def test_the_error_fraction_is_judged_over_every_ranks_completions():
    rank0, rank1 = run_world(2, judge)
    assert rank0 == rank1
    assert rank0["3 of 8"] is None
    assert rank0["5 of 8"] == (
        "reward 'picky' (rewards.py:picky) failed on 5 of 8 completions, more than "
        "max_error_fraction = 0.5 (fix the reward, or raise it); the first: returned 'n/a' "
        "(str), not a number on train.jsonl:1"
    )
