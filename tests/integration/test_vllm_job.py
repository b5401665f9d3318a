"""The GRPO job with `[rollout] generator = "vllm"` end to end on a real vLLM engine (the CPU
build here and in CI): a user's Hugging Face directory (head_dim 64, which the CPU attention
takes), GSM8K-format prompts, the math reward and a user reward, evaluation, a checkpoint and a
resume. The engine starts from [model] hf_checkpoint, with no [rollout.vllm] section (on CPU
the job sizes its memory), and takes the learner's weights after every update; the learner's
first update of each step must then find its own log-probs in the rollout (an importance ratio
of 1)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.vllm import needs_vllm, vllm_job_config, write_vllm_job_files
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.job.grpo import run

pytestmark = [pytest.mark.slow, needs_vllm]


def vllm_job(rank: int, root: str) -> dict:
    root = Path(root)
    source = str(root / "run.toml")
    model = write_vllm_job_files(root)
    # no [rollout.vllm]: on CPU the job sizes the engine's memory itself
    tables = vllm_job_config(root, model, steps=3, checkpoint={"interval": 2})
    history = run(config_from_dict(tables, source))
    # what a crash during step 3's save leaves: step 2 the last committed (the last step of a
    # run is saved too, so only a crash leaves a step unsaved)
    checkpoints = root / "run" / "out" / "checkpoints"
    shutil.rmtree(checkpoints / "step-3")
    (checkpoints / "latest").write_text("step-2\n")
    tables["run"]["steps"] = 4
    resumed = run(config_from_dict(tables, source), resume=True)
    # One step off-policy: the engine samples in the pipeline's thread while the learner trains.
    tables["run"].update(steps=3, output_dir=str(root / "ahead"))
    tables["rollout"]["max_off_policy_steps"] = 1
    tables["eval"]["every_steps"] = 0
    tables["checkpoint"]["interval"] = 0
    ahead = run(config_from_dict(tables, source))
    return {"history": history, "resumed": resumed, "ahead": ahead}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_job")
    [results] = run_world(1, vllm_job, str(root))
    return root, results


def test_the_job_trains_on_vllm_rollouts_of_its_current_weights(job):
    root, results = job
    history = results["history"]
    assert [int(m["policy_version"]) for m in history] == [1, 2, 3]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        # the engine served the weights being trained: importance ratio 1, nothing clipped
        assert abs(metrics["kl_approx"]) < 1e-5 and metrics["clip_fraction"] == 0
        assert metrics["logprob_mismatch_max"] < 1e-5  # vLLM vs the learner, fp32 on CPU
        assert metrics["weight_sync_s"] > 0
    lines = (root / "run/out/metrics.jsonl").read_text().splitlines()
    assert any("eval/pass@1" in json.loads(line) for line in lines)


def test_a_resumed_vllm_job_repeats_the_step_it_had_not_saved(job):
    root, results = job
    assert (root / "run/out/checkpoints/step-2").is_dir()
    first, resumed = results["history"], results["resumed"]
    assert [int(m["policy_version"]) for m in resumed] == [3, 4]
    for key in ("reward_mean", "response_length_mean", "loss_objective", "grad_norm"):
        assert resumed[0][key] == pytest.approx(first[2][key], rel=1e-5, abs=1e-7), key


def test_the_engine_samples_one_version_ahead_in_the_pipeline_thread(job):
    _, results = job
    ahead = results["ahead"]
    assert [m["staleness_max"] for m in ahead] == [0.0, 1.0, 1.0]
    assert [int(m["policy_version"]) for m in ahead] == [1, 2, 3]
    # the engine vs the learner under the same weights, also on stale steps (kept for them) ...
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in ahead), ahead
    assert all(abs(m["kl_approx"]) > 1e-6 for m in ahead[1:])  # ... where the learner moved on


def test_slurms_sigterm_to_every_process_saves_the_step_the_engine_is_sampling(tmp_path):
    """SIGTERM as `srun torchrun` delivers it: to every process of the job, the vLLM engine's
    processes too, and twice (Slurm's, then torchrun's forwarding). The engine keeps serving
    its trainer, which finishes the step, saves it and exits 0; before, vLLM took the signal as
    its own shutdown and the step failed with EngineDeadError, nothing saved."""
    model = write_vllm_job_files(tmp_path)
    tables = vllm_job_config(tmp_path, model, steps=200)
    tables["eval"]["every_steps"] = 0
    config = tmp_path / "run.toml"
    config.write_text(config_to_toml(config_from_dict(tables, str(config))))
    metrics = tmp_path / "run" / "out" / "metrics.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "titan_learner", "train", "--config", str(config)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and metrics.read_text().count("training/reward_mean") >= 2:
            break
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    os.killpg(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out[-3000:]
    saved = (tmp_path / "run" / "out" / "checkpoints" / "latest").read_text().strip()
    assert f"preempted (SIGTERM): saved step {saved.removeprefix('step-')} to " in out
    assert "SIGTERM ignored: this engine stops when its trainer stops it" in out
    assert "EngineDeadError" not in out
