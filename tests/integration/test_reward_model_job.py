"""A GRPO job scored by a reward model plus a rule reward, under dp_shard = 2 (gloo): each rank
scores its own rows through the reward model's tokenizer and chat template, the total is the
configured weighted sum, per-reward time and truncation are logged, and the running normalizer's
statistics are saved in the checkpoint: a resumed run scores its next step as the uninterrupted
run does. Sampling ahead of the learner, the rewards are computed in the rollout thread,
alongside the update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hf_dirs import (
    job_config,
    make_model_dir,
    make_reward_model_dir,
    write_gsm8k_jsonl,
)
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict
from titan_learner.job.grpo import run

pytestmark = pytest.mark.slow

REWARDS = [
    {
        "model": "reward-model",
        "name": "rm",
        "weight": 0.5,
        "batch_size": 3,
        "max_length": 20,
        "normalize": "running",
    },
    {"function": "math", "weight": 2.0, "workers": 2},
]


def reward_model_runs(rank: int, root: str, model: dict) -> dict:
    root = Path(root)
    source = str(root / "run.toml")  # the reward model's relative path resolves from here

    def tables(name: str, steps: int) -> dict:
        return job_config(
            root / name,
            model,
            {"train_files": ["train.jsonl"]},
            steps=steps,
            reward=REWARDS,
            parallelism={"dp_shard": 2},
            checkpoint={"interval": 1},
        )

    results = {"straight": run(config_from_dict(tables("straight", 3), source))}
    run(config_from_dict(tables("resumed", 2), source))
    results["resumed"] = run(config_from_dict(tables("resumed", 3), source), resume=True)
    plain = tables("added", 1)
    plain["reward"] = [{**REWARDS[0], "normalize": "none"}, REWARDS[1]]
    run(config_from_dict(plain, source))
    results["added"] = run(config_from_dict(tables("added", 2), source), resume=True)
    ahead = tables("ahead", 3)
    ahead["reward"] = [{"function": "math"}, {"function": "slow.py:score", "workers": 0}]
    ahead["rollout"] |= {"max_off_policy_steps": 1, "stale_logprob_mismatch": False}
    results["ahead"] = run(config_from_dict(ahead, source))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_job")
    model = make_model_dir(root / "llama")
    make_reward_model_dir(root / "reward-model")
    write_gsm8k_jsonl(root / "train.jsonl")
    (root / "slow.py").write_text(
        "import time\ndef score(prompt, completion, row):\n    time.sleep(0.25)\n    return 0.0\n"
    )
    results = run_world(2, reward_model_runs, str(root), model)
    return root, results


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_total_is_the_weighted_sum_of_the_model_and_the_rule(runs):
    root, results = runs
    history = results[0]["straight"]
    assert len(history) == 3
    keys = ("reward_mean", "reward/rm_mean", "reward/math_mean", "reward/rm_truncated")
    for mine, other in zip(history, results[1]["straight"], strict=True):  # every rank agrees
        assert [mine[k] for k in keys] == [other[k] for k in keys]
        assert mine["reward/rm_s"] == other["reward/rm_s"]  # the slowest rank's
    for metrics in history:
        assert {"reward/rm_mean", "reward/math_mean", "reward/rm_s", "reward/math_s"} <= set(
            metrics
        )
        assert metrics["reward/rm_s"] > 0 and metrics["reward/math_s"] > 0
        assert 0 <= metrics["reward/rm_truncated"] <= 8  # of 4 prompts x 2 completions
        assert metrics["reward_mean"] == pytest.approx(
            0.5 * metrics["reward/rm_mean"] + 2.0 * metrics["reward/math_mean"], abs=1e-5
        )
    assert sum(m["reward/rm_truncated"] for m in history) > 0  # max_length 20 cuts some
    samples = records(root / "straight" / "out" / "samples.jsonl")
    assert len(samples) >= 3
    for sample in samples:
        assert sample["reward"] == pytest.approx(
            0.5 * sample["reward/rm"] + 2.0 * sample["reward/math"], abs=1e-5
        )
    logged = records(root / "straight" / "out" / "metrics.jsonl")
    assert all("training/reward/rm_truncated" in r for r in logged if "training/reward_mean" in r)


def test_the_running_normalizer_resumes_from_the_checkpoint(runs):
    _, results = runs
    straight, resumed = results[0]["straight"], results[0]["resumed"]
    assert len(resumed) == 1
    # normalized by the statistics of steps 1-2 plus step 3: the same only if they were restored
    assert resumed[0]["reward/rm_mean"] == pytest.approx(straight[2]["reward/rm_mean"], abs=1e-6)
    assert resumed[0]["reward_mean"] == pytest.approx(straight[2]["reward_mean"], abs=1e-6)


def test_a_normalizer_added_on_resume_starts_afresh(runs):
    _, results = runs
    [step_2] = results[0]["added"]
    # step 2's scores standardized by their own statistics alone: mean 0 over every rank
    assert step_2["reward/rm_mean"] == pytest.approx(0.0, abs=1e-5)


def test_sampling_ahead_scores_in_the_rollout_thread(runs):
    _, results = runs
    history = results[0]["ahead"]
    assert len(history) == 3
    for metrics in history:
        assert metrics["reward/score_s"] >= 4 * 0.25  # 4 completions a rank, one at a time
        # what the step itself waited for: the scores were ready, only their collectives ran
        assert metrics["reward_s"] < 0.5 * metrics["reward/score_s"]
