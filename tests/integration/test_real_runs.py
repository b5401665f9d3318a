"""GRPO on a user's files: a Hugging Face model directory (tiny random Llama / Qwen3 saved with
save_pretrained, a tokenizer with a chat template and two EOS ids), GSM8K-format JSONL and
Parquet prompts, the math reward and a user reward, evaluation; and what happens when a reward
fails while the job runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.hf_dirs import (
    USER_REWARD,
    job_config,
    make_model_dir,
    write_gsm8k_jsonl,
    write_parquet,
)
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict
from titan_learner.job.grpo import run
from titan_learner.rewards.runner import RewardError


def real_runs(rank: int, root: str) -> dict:
    root = Path(root)
    (root / "user_reward.py").write_text(USER_REWARD)
    source = str(root / "run.toml")  # relative paths in the config resolve from here
    llama = make_model_dir(root / "llama")
    qwen = make_model_dir(root / "qwen", "qwen3")
    write_gsm8k_jsonl(root / "train.jsonl")
    write_gsm8k_jsonl(root / "test.jsonl")
    write_parquet(root / "train.parquet")
    results = {}
    jsonl = {"train_files": ["train.jsonl"], "eval_files": ["test.jsonl"]}
    results["llama"] = run(config_from_dict(job_config(root / "llama_run", llama, jsonl), source))
    parquet = {"train_files": ["train.parquet"]}
    results["qwen3"] = run(config_from_dict(job_config(root / "qwen_run", qwen, parquet), source))
    failing = job_config(root / "fail_run", llama, jsonl)
    (root / "bad_reward.py").write_text(
        "def score(prompt, completion, row):\n    if '5' in row['answer']:\n        raise ValueError('no fives')\n    return 0.0\n"
    )
    failing["reward"] = [{"function": "bad_reward.py:score", "name": "picky"}]
    try:
        run(config_from_dict(failing, source))
        results["error"] = None
    except RewardError as err:
        results["error"] = str(err)
    failing["reward"][0]["on_error"] = "zero"
    failing["run"]["output_dir"] = str(root / "zero_run")
    results["zero"] = run(config_from_dict(failing, source))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    [results] = run_world(1, real_runs, str(root))
    return root, results


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_hugging_face_directory_with_jsonl_math_reward_and_eval(runs):
    root, results = runs
    history = results["llama"]
    assert len(history) == 2
    for metrics in history:
        assert {"reward/math_mean", "reward/length_mean", "reward_errors", "epoch"} <= set(metrics)
        assert 0 <= metrics["reward/math_mean"] <= 1 and metrics["reward_errors"] == 0
        # The generator gets the bf16 export ([learner] export_dtype) of fp32 weights: the
        # metric sees that rounding (an fp32 export gives < 1e-5: test_vllm_job, toy default).
        assert 1e-5 < metrics["logprob_mismatch_max"] < 0.05
    out = root / "llama_run" / "out"
    logged = [r for r in records(out / "metrics.jsonl") if "training/logprob_mismatch" in r]
    assert len(logged) == 2 and all("training/logprob_mismatch_max" in r for r in logged)
    evals = [r for r in records(out / "metrics.jsonl") if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2]
    completions = records(out / "eval" / "step_2.jsonl")
    assert len(completions) == 4 and all(len(r["completions"]) == 2 for r in completions)
    samples = records(out / "samples.jsonl")
    assert {s["step"] for s in samples} == {1, 2}
    assert all(s["origin"].startswith(str(root / "train.jsonl")) for s in samples)
    assert all({"prompt", "completion", "reward", "reward/math"} <= set(s) for s in samples)
    # the prompt the model saw, chat template and system prompt included, beside the raw row
    for sample in samples:
        assert sample["row"]["question"] == sample["prompt"]
        assert sample["rendered_prompt"] == (
            "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
            f"<|im_start|>user\n{sample['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        )


def test_qwen3_directory_with_parquet_prompts(runs):
    _, results = runs
    assert len(results["qwen3"]) == 2
    assert results["qwen3"][0]["epoch"] == pytest.approx(0.5)  # 4 of the 8 prompts per step


def test_a_reward_that_raises_stops_with_one_line_naming_the_row(runs):
    root, results = runs
    message = results["error"]
    assert message is not None and "\n" not in message
    assert message.startswith(
        "reward 'picky' (bad_reward.py:score) raised (ValueError: no fives) on "
    )
    # the first failure names its row: here an eval row, scored before the first step
    assert re.search(rf"on {re.escape(str(root))}/(train|test)\.jsonl:\d+; allowed: ", message)


def test_on_error_zero_counts_the_errors_and_goes_on(runs):
    _, results = runs
    assert len(results["zero"]) == 2
    assert sum(m["reward_errors"] for m in results["zero"]) > 0
