"""The GRPO job with multi-turn episodes on a user's files: a tiny random Llama directory, a
user environment (a user simulator that asks for more) and a tool, on the embedded generator.
The job trains on the episodes (the model's turns alone), reports the episode metrics, and the
engine mismatch stays at its single-turn level; a resume in the middle repeats the
uninterrupted run; a user environment that raises stops the job with one line naming it and
the row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hf_dirs import job_config, make_model_dir, write_gsm8k_jsonl
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.env.environment import EnvError
from titan_learner.job.grpo import run

ENVS = '''
class GoOn:
    """Asks for more until the third answer; rewards an answer that says the row's number."""

    def reset(self, row):
        self.answer = row["answer"].split()[-1]
        return [{"role": "user", "content": row["question"]}]

    def step(self, messages, completion):
        asked = sum(m["role"] == "user" for m in messages)
        return [{"role": "user", "content": "Go on."}], float(self.answer in completion), asked >= 3


class Broken(GoOn):
    def step(self, messages, completion):
        raise ValueError("the simulator crashed")
'''
TOOLS = '''
def lookup(key: str) -> str:
    """Look a key up.

    key: what to look up
    """
    return {"five": "5"}[key]
'''


def multiturn_runs(rank: int, root: str) -> dict:
    root = Path(root)
    (root / "envs.py").write_text(ENVS)
    (root / "tools.py").write_text(TOOLS)
    source = str(root / "run.toml")
    llama = make_model_dir(root / "llama")
    write_gsm8k_jsonl(root / "train.jsonl")
    data = {"train_files": ["train.jsonl"], "eval_files": ["train.jsonl"], "max_prompt_tokens": 64}

    def tables(name: str, steps: int) -> dict:
        made = job_config(
            root / name,
            llama,
            data,
            steps=steps,
            reward=[{"function": "math"}],
            env={"class": "envs.py:GoOn", "max_turns": 3, "max_total_tokens": 256},
            tool=[{"function": "tools.py:lookup"}],
            checkpoint={"interval": 1},
        )
        made["rollout"]["max_new_tokens"] = 48
        return made

    results = {"history": run(config_from_dict(tables("run", 3), source))}
    ahead = ["whole", "preempted"]
    for name in ahead:
        made = tables(name, 5)
        made["rollout"]["max_off_policy_steps"] = 1
        made["checkpoint"]["interval"] = 2
        made.pop("eval")
        ahead_source = config_from_dict(made, source)
        if name == "preempted":
            results[name] = preempted_at(ahead_source, stop_after=3)
            results["after"] = run(ahead_source, resume=True)
        else:
            results[name] = run(ahead_source)
    dynamic = tables("dynamic", 2)
    dynamic["rollout"] |= {"dynamic_sampling": True, "max_sampling_rounds": 3}
    dynamic.pop("eval")
    results["dynamic"] = run(config_from_dict(dynamic, source))
    run(config_from_dict(tables("resumed", 2), source))
    results["resumed"] = run(config_from_dict(tables("resumed", 3), source), resume=True)
    tables = tables("broken", 1)
    tables["env"]["class"] = "envs.py:Broken"
    broken = config_from_dict(tables, source)
    (root / "broken.toml").write_text(config_to_toml(broken))  # for `train` (below)
    try:
        run(broken)
        results["error"] = None
    except EnvError as err:
        results["error"] = str(err)
    return results


def preempted_at(config, stop_after: int) -> list[dict]:
    """The run, sent SIGTERM while it trains step `stop_after`."""
    import signal

    from titan_learner.job import grpo

    train_on, calls = grpo.train_on, {"n": 0}

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == stop_after:
            signal.raise_signal(signal.SIGTERM)
        return train_on(*args, **kwargs)

    grpo.train_on = signalled
    try:
        return run(config)
    finally:
        grpo.train_on = train_on


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    [results] = run_world(1, multiturn_runs, str(root))
    return root, results


def test_a_user_environment_with_a_tool_trains_through_the_job(runs):
    root, results = runs
    history = results["history"]
    assert len(history) == 3
    for metrics in history:
        assert {"turns_mean", "tool_calls_mean", "tool_errors", "episode_tokens_mean"} <= set(
            metrics
        )
        assert {"episodes_truncated", "reward/env_mean", "reward/math_mean"} <= set(metrics)
        assert 1 <= metrics["turns_mean"] <= 3
        # the trained log-probs are the sampled ones: the bf16 export's rounding alone
        assert metrics["logprob_mismatch_max"] < 0.05
    assert max(m["turns_mean"] for m in history) > 1  # some episodes went on
    out = root / "run" / "out"
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("training/turns_mean" in r for r in logged)
    assert [r["step"] for r in logged if "eval/pass@1" in r] == [0, 3]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(
        {"episode", "turns", "tool_calls", "completion"} <= set(s) for s in samples
    )
    went_on = [s for s in samples if s["turns"] > 1]
    assert went_on and all("Go on." in s["episode"] for s in went_on)


def test_episodes_sampled_ahead_resume_exactly_after_a_preemption(runs):
    """One step off-policy: episodes sampled in the rollout thread under the previous version
    (the engine mismatch measured under the weights kept for it); SIGTERM at step 3, between
    sync points, saves step 4's queued episodes, and the resumed run trains on them as the
    uninterrupted run did."""
    _, results = runs
    whole = results["whole"]
    assert [m["staleness_max"] for m in whole] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(m["turns_mean"] >= 1 and "reward/env_mean" in m for m in whole)
    assert len(results["preempted"]) == 3 and len(results["after"]) == 2
    keys = ["reward_mean", "loss_objective", "grad_norm", "staleness_max", "turns_mean"]
    keys += ["tool_calls_mean", "episode_tokens_mean", "reward/env_mean"]
    for got, want in zip(results["preempted"] + results["after"], whole, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


def test_dynamic_sampling_keeps_whole_groups_of_episodes(runs):
    """DAPO's rounds over episodes: each round scored as episodes (the last turn by the
    rewards, plus the environment's), the kept groups' episodes trained and logged whole."""
    root, results = runs
    for metrics in results["dynamic"]:
        assert {"sampling_rounds", "groups_dropped", "turns_mean", "reward/env_mean"} <= set(
            metrics
        ), metrics
        assert 1 <= metrics["sampling_rounds"] <= 3 and 1 <= metrics["turns_mean"] <= 3
    out = root / "dynamic" / "out"
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all({"episode", "turns", "reward/env"} <= set(s) for s in samples)


def test_a_resume_in_the_middle_repeats_the_uninterrupted_run(runs):
    _, results = runs
    straight, resumed = results["history"][-1], results["resumed"][-1]
    keys = [
        "loss_objective",
        "reward_mean",
        "turns_mean",
        "tool_calls_mean",
        "episode_tokens_mean",
        "episodes_truncated",
        "logprob_mismatch",
        "grad_norm",
    ]
    assert {k: resumed[k] for k in keys} == {k: straight[k] for k in keys}


def test_a_user_environment_that_raises_is_one_line_naming_it_and_the_row(runs):
    root, results = runs
    error = results["error"]
    assert error is not None and "\n" not in error
    assert error.startswith(f"[env] class 'envs.py:Broken' raised on {root / 'train.jsonl'}:")
    assert error.endswith("at turn 1: ValueError: the simulator crashed")


@pytest.mark.parametrize("ahead", [0, 1])
def test_train_stops_on_a_raising_environment_with_its_line_and_exit_2(runs, ahead):
    """Through `titan-learner train`: that line alone, no traceback, also when the episodes
    are sampled ahead in the rollout thread (max_off_policy_steps = 1; no evaluation, which
    samples on the learner's thread)."""
    root, _ = runs
    sets = [f'run.output_dir="{root / f"cli{ahead}"}"', f"rollout.max_off_policy_steps={ahead}"]
    sets += ["data.eval_files=[]"] if ahead else []
    done = subprocess.run(
        [sys.executable, "-m", "titan_learner", "train", "--config", str(root / "broken.toml")]
        + [arg for s in sets for arg in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: [env] class 'envs.py:Broken' raised on {root}/train.jsonl:")
    assert line.endswith("at turn 1: ValueError: the simulator crashed"), line
