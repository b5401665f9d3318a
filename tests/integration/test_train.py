"""The GRPO job: runs alone and on 2 gloo ranks (FSDP), learns, reproduces, rejects bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worlds import run_world
from titan_learner.config.toml import load_config
from titan_learner.job.grpo import run
from titan_learner.train import main

ROOT = Path(__file__).parents[2]
TOY = ROOT / "configs" / "toy_grpo.toml"


def short_run(
    rank: int, output_dir: str, steps: int, overrides: list[str], resume: bool = False
) -> list[dict]:
    config = load_config(
        TOY,
        [
            f"run.steps={steps}",
            f'run.output_dir="{output_dir}"',
            "checkpoint.interval=0",
            "rollout.prompts_per_step=16",
            "rollout.group_size=8",
            "eval.max_prompts=16",
            *overrides,
        ],
    )
    return run(config, resume=resume)


def interrupted_and_whole(
    rank: int, root: str, overrides: tuple[str, ...] = (), cut: int = 3
) -> dict[str, list[dict]]:
    """4 steps saved every 2, whole; and cut after `cut` steps, then resumed to 4 (a cut at 3:
    the last step is saved too, and the resume starts there). `overrides`: the run's own."""
    every_2 = [*overrides, "checkpoint.interval=2"]
    return {
        "whole": short_run(rank, f"{root}/whole", 4, every_2),
        "first": short_run(rank, f"{root}/cut", cut, every_2),
        "resumed": short_run(rank, f"{root}/cut", 4, every_2, resume=True),
    }


def test_few_steps_on_one_process_write_metrics_and_curves(tmp_path):
    [history] = run_world(1, short_run, str(tmp_path), 3, [])
    assert len(history) == 3
    for metrics in history:
        for key in ("reward_mean", "loss_objective", "grad_norm", "lr", "ESS", "clip_fraction"):
            assert key in metrics, key
        assert metrics["rollout_s"] > 0 and metrics["update_s"] > 0 and metrics["tokens_per_s"] > 0
        # what a GRPO researcher reads first; entropy although the toy has no entropy bonus
        assert metrics["entropy"] > 0 and "loss_entropy" not in metrics
        lengths = [metrics[f"response_length_{k}"] for k in ("min", "mean", "max")]
        assert 1 <= lengths[0] <= lengths[1] <= lengths[2] <= 8  # max_new_tokens
        for key in ("truncated_fraction", "groups_zero_variance_fraction"):
            assert 0 <= metrics[key] <= 1, key
        assert metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-5)  # per group, so overall
        assert metrics["advantage_abs_max"] > 0 and metrics["advantage_std"] > 0
        sides = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
        assert sides == pytest.approx(metrics["clip_fraction"], abs=1e-6)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in records if "training/reward_mean" in r]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0]["training/reward_mean"] == pytest.approx(history[0]["reward_mean"])
    # the eval split is scored before training and at the end, its completions kept to read
    evals = [r for r in records if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert {"eval/reward_mean", "eval/pass@k", "eval/prompts"} <= set(evals[0])
    assert (tmp_path / "eval" / "step_0.jsonl").exists() and (
        tmp_path / "eval" / "step_3.jsonl"
    ).exists()
    assert "training/reward/sorted_mean" in lines[0] and "training/reward_errors" in lines[0]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((tmp_path / "tensorboard").iterdir())
    # a weight push follows every update: the generator serves the new policy version
    assert [m["policy_version"] for m in history] == [1.0, 2.0, 3.0]


def test_a_token_budget_trains_the_job_like_one_padded_batch(tmp_path):
    """`[learner] max_tokens_per_microbatch`: the job hands each rank's whole batch to update(),
    which packs it by length into micro-batches of at most 64 positions; same step, same run."""
    [padded] = run_world(1, short_run, str(tmp_path / "padded"), 2, ["eval.every_steps=0"])
    budget = ["eval.every_steps=0", "learner.max_tokens_per_microbatch=64"]
    [budgeted] = run_world(1, short_run, str(tmp_path / "budget"), 2, budget)
    for want, got in zip(padded, budgeted, strict=True):
        for key in ("reward_mean", "loss_objective", "grad_norm", "clip_fraction", "entropy"):
            if key in want:
                assert got[key] == pytest.approx(want[key], abs=1e-5), key


@pytest.mark.slow
def test_two_ranks_fsdp_agree_on_metrics(tmp_path):
    """dp_shard=2: each rank samples its half of the prompts; reported metrics are global."""
    rank0, rank1 = run_world(2, short_run, str(tmp_path), 2, ["parallelism.dp_shard=2"])
    assert len(rank0) == 2
    for a, b in zip(rank0, rank1, strict=True):
        for key in ("reward_mean", "reward_std", "loss_objective", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_seeded_run_learns_and_reproduces(tmp_path):
    """From a random policy, 40 steps raise the mean reward by a clear margin, step for step
    the same when repeated under the same seed."""
    overrides = ["rollout.prompts_per_step=32", "rollout.group_size=16", "optimizer.lr=2e-3"]
    first = run_world(1, short_run, str(tmp_path / "a"), 40, overrides)[0]
    rewards = [m["reward_mean"] for m in first]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert late > 2 * early and late > early + 0.1, (early, late)
    again = run_world(1, short_run, str(tmp_path / "b"), 5, overrides)[0]
    assert [m["reward_mean"] for m in again] == rewards[:5]
    assert [m["loss_objective"] for m in again] == [m["loss_objective"] for m in first[:5]]


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    runs = run_world(1, interrupted_and_whole, str(tmp_path))[0]
    assert len(runs["first"]) == 3 and len(runs["resumed"]) == 1
    for got, want in zip(runs["first"] + runs["resumed"], runs["whole"], strict=True):
        for key in ("reward_mean", "loss_objective", "grad_norm", "policy_version"):
            assert got[key] == want[key], key
    steps = [line["step"] for line in training_lines(tmp_path / "cut")]
    assert steps == [1, 2, 3, 4], "the resumed run appends to the metrics, no duplicate steps"
    elapsed = [line["training/elapsed_s"] for line in training_lines(tmp_path / "cut")]
    assert elapsed == sorted(elapsed) and elapsed[3] > elapsed[2], "continued, not restarted"
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step-4"


BAD_JOBS = {
    "no prompts": (
        ["data.train_files=[]"],
        "[data] train_files: none given; allowed: one or more local JSONL, JSON or Parquet files",
    ),
    "vocabulary too small": (
        ["model.overrides.vocab_size=12"],
        "[tokenizer] path: the tokenizer has 14 tokens but the model's vocab_size is 12",
    ),
    "prompts not divisible": (
        ["rollout.prompts_per_step=3", "parallelism.dp_shard=2", "--world-size-2"],
        "[rollout] prompts_per_step: 3 prompts do not split over 2 data-parallel ranks",
    ),
    "sequence too long for the model": (
        ["model.overrides.max_seq_len=20"],
        "[data] max_prompt_tokens: max_prompt_tokens + max_new_tokens = 16 + 8 = 24 positions, "
        "but the model covers 20 (max_seq_len)",
    ),
    "group of one": (
        ["rollout.group_size=1"],
        "[rollout] group_size: 1 is out of range; allowed: >= 2",
    ),
}


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_bad_job_input_is_one_error_before_any_compute(case, capsys, monkeypatch):
    overrides, message = BAD_JOBS[case]
    if "--world-size-2" in overrides:
        overrides = [o for o in overrides if o != "--world-size-2"]
        monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--config", str(TOY)] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {TOY}: ") and err.count("\n") == 1
    assert message in err, err


def test_missing_config_exits_2_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "titan_learner.train", "--config", "configs/nope.toml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert result.stderr == "error: configs/nope.toml: file not found\n"


def test_resume_takes_auto_or_nothing(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--config", str(TOY), "--resume", "latest"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --resume: 'latest' is not a resume mode; allowed: --resume alone or "
        "--resume auto\n"
    )


def test_a_torchrun_restart_of_a_finished_run_does_nothing(tmp_path, capsys, monkeypatch):
    """A restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) behaves as --resume auto,
    without the flag: here the run had finished, so it is one line and exit 0."""
    (tmp_path / "finished.json").write_text('{"step": 3}\n')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = ["--config", str(TOY), "--set", "run.steps=3", "--set", f'run.output_dir="{tmp_path}"']
    assert main(args) == 0
    assert capsys.readouterr().out == (
        "torchrun restart 1: resuming as --resume auto\n"
        f"{tmp_path} already finished its 3 steps ([run] steps = 3); nothing to do\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["finished.json"]


def first_prompt_per_step(output_dir: Path) -> dict[int, str]:
    """The first sampled prompt of every step (rank 0's slice starts the step's global list)."""
    firsts: dict[int, str] = {}
    for line in (output_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        firsts.setdefault(record["step"], record["origin"])
    return firsts


@pytest.mark.slow
def test_resume_on_another_data_parallel_size_sees_the_same_prompts(tmp_path):
    """The data position travels in the checkpoint: 2 steps on one rank, resumed on dp_shard=2,
    train on exactly the prompts of an uninterrupted one-rank run."""
    overrides = ["checkpoint.interval=2", "run.log_samples_every=1"]
    run_world(1, short_run, str(tmp_path / "whole"), 4, overrides)
    run_world(1, short_run, str(tmp_path / "cut"), 2, overrides)
    run_world(2, short_run, str(tmp_path / "cut"), 4, [*overrides, "parallelism.dp_shard=2"], True)
    whole, cut = first_prompt_per_step(tmp_path / "whole"), first_prompt_per_step(tmp_path / "cut")
    assert sorted(cut) == [1, 2, 3, 4] and cut == whole


def training_lines(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "training/reward_mean" in r]


@pytest.mark.slow
def test_sigterm_saves_the_step_and_resume_continues_exactly(tmp_path):
    """Slurm's and Kubernetes' SIGTERM: the step finishes, a checkpoint is written, exit 0 with
    one line; --resume then continues exactly like a run that was never stopped. Sent as `srun
    torchrun` delivers it: to every process of the job, the reward workers too, and twice (Slurm
    signals the rank, and torchrun forwards its own)."""
    import signal
    import time

    common = [
        "--config", str(TOY), "--set", "rollout.prompts_per_step=16", "--set", "rollout.group_size=8",
        "--set", "eval.every_steps=0", "--set", "eval.max_prompts=16", "--set", "checkpoint.interval=0",
    ]  # fmt: skip
    cut = tmp_path / "cut"
    process = subprocess.Popen(
        [sys.executable, "-m", "titan_learner", "train", *common,
         "--set", "run.steps=200", "--set", f'run.output_dir="{cut}"'],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while len(training_lines(cut)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    stopped = len(training_lines(cut))
    assert f"preempted (SIGTERM): saved step {stopped} to {cut / 'checkpoints'}" in out
    assert (cut / "checkpoints" / "latest").read_text().strip() == f"step-{stopped}"
    steps = stopped + 2
    resumed = subprocess.run(
        [sys.executable, "-m", "titan_learner", "train", *common, "--resume",
         "--set", f"run.steps={steps}", "--set", f'run.output_dir="{cut}"'],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    whole = tmp_path / "whole"
    subprocess.run(
        [sys.executable, "-m", "titan_learner", "train", *common,
         "--set", f"run.steps={steps}", "--set", f'run.output_dir="{whole}"'],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    keys = ("training/reward_mean", "training/loss_objective", "training/grad_norm")
    got = [[r[k] for k in keys] for r in training_lines(cut)]
    want = [[r[k] for k in keys] for r in training_lines(whole)]
    assert len(got) == steps and got == want


def test_resume_with_a_changed_config_lists_the_changes_or_refuses_the_model(tmp_path, capsys):
    base = [
        "--config", str(TOY), "--set", "rollout.prompts_per_step=16", "--set", "rollout.group_size=8",
        "--set", "eval.max_prompts=8", "--set", "checkpoint.interval=1",
        "--set", f'run.output_dir="{tmp_path}"',
    ]  # fmt: skip
    assert main([*base, "--set", "run.steps=1"]) == 0
    capsys.readouterr()
    assert main([*base, "--resume", "--set", "run.steps=2", "--set", "optimizer.lr=1e-4"]) == 0
    out = capsys.readouterr().out
    assert "resuming with changed: optimizer.lr 0.0007 -> 0.0001, run.steps 1 -> 2" in out
    assert main([*base, "--resume", "--set", "run.steps=3", "--set", "model.overrides.dim=32"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {TOY}: [model.overrides] dim: the checkpoint in {tmp_path / 'checkpoints'} was "
        "trained with dim = 64, the config says 32; allowed: 64 (what a checkpoint holds cannot "
        "change on resume), or a new output_dir\n"
    )


def test_a_resume_with_another_model_is_refused_before_the_build(tmp_path, capsys, monkeypatch):
    """Without the config.toml to compare keys with (or with another hf_checkpoint directory),
    the checkpoint's own tensor shapes refuse another model, before anything is built."""
    base = [
        "--config", str(TOY), "--set", "rollout.prompts_per_step=16", "--set", "rollout.group_size=8",
        "--set", "eval.max_prompts=8", "--set", "checkpoint.interval=1",
        "--set", f'run.output_dir="{tmp_path}"',
    ]  # fmt: skip
    assert main([*base, "--set", "run.steps=1"]) == 0
    (tmp_path / "checkpoints" / "config.toml").unlink()
    capsys.readouterr()

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the resume was refused")

    monkeypatch.setattr("titan_learner.learner.titan.TitanLearner.from_config", no_build)
    wider = ["--set", "run.steps=2", "--set", "model.overrides.hidden_dim=128"]
    assert main([*base, "--resume", *wider]) == 2
    assert capsys.readouterr().err == (
        f"error: {TOY}: [model]: the checkpoint {tmp_path / 'checkpoints' / 'step-1'} holds "
        "another model than this config builds (6 mismatched: layers.0.feed_forward.w1.weight "
        "(shape (256, 64) saved, (128, 64) here), layers.0.feed_forward.w2.weight (shape (64, "
        "256) saved, (64, 128) here), layers.0.feed_forward.w3.weight (shape (256, 64) saved, "
        "(128, 64) here), ... (3 more)); allowed: the model it was trained with, or a new "
        "output_dir\n"
    )


BROKEN_REWARD = "def score(prompt, completion, row):\n    return 'one'  # a string, not a number\n"


def broken_reward_run(rank: int, root: str, max_error_fraction: float) -> list[dict] | str:
    """One step of the toy job whose only reward returns a string, with on_error = "zero"."""
    import dataclasses

    from titan_learner.rewards.runner import RewardError

    Path(root).mkdir(parents=True, exist_ok=True)
    (Path(root) / "broken.py").write_text(BROKEN_REWARD)
    config = load_config(
        TOY,
        [
            "run.steps=1",
            f'run.output_dir="{root}/out"',
            "checkpoint.interval=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "eval.max_prompts=4",
        ],
    )
    broken = dataclasses.replace(
        config.reward[0],
        function=f"{root}/broken.py:score",
        on_error="zero",
        max_error_fraction=max_error_fraction,
    )
    try:
        return run(dataclasses.replace(config, reward=[broken]))
    except RewardError as err:
        return str(err)


def test_a_reward_failing_on_every_row_stops_the_job_unless_tolerated(tmp_path):
    """on_error = "zero" must not train on zeros unnoticed: past max_error_fraction (0.5 by
    default) the job stops with one line; a tolerated failure is counted on every step."""
    [message] = run_world(1, broken_reward_run, str(tmp_path / "strict"), 0.5)
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith(
        f"reward 'sorted' ({tmp_path}/strict/broken.py:score) failed on 16 of 16 completions, "
        "more than max_error_fraction = 0.5 (fix the reward, or raise it); the first: returned "
        "'one' (str), not a number on "
    ), message
    [history] = run_world(1, broken_reward_run, str(tmp_path / "lenient"), 1.0)
    assert [m["reward_errors"] for m in history] == [16.0]
    assert history[0]["reward_mean"] == 0.0
