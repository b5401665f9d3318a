"""The job under the real torchrun, as users launch it: a user error is one line, printed once
(by rank 0 unless it is slower than its grace), whose exit 2 is what torchrun reports as the
root cause (torchrun then adds its own report of the failed ranks, which the job cannot
suppress); a run that succeeds prints none of the launcher-level noise that a user cannot act
on."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.restarts import (
    committed_step,
    kill_when,
    lock_holder,
    repeatable,
    saved_state,
    toy_job,
    training_rows,
)

pytestmark = pytest.mark.slow

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"


def launcher(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *options]


def torchrun(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    overrides = [
        "parallelism.dp_shard=2",
        f'run.output_dir="{tmp_path / "run"}"',
        "run.steps=1",
        "eval.every_steps=0",
        "data.eval_files=[]",
        *sets,
    ]
    command = launcher("--standalone", "-m", "titan_learner", "train", "--config", str(TOY))
    command += [a for o in overrides for a in ("--set", o)]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_a_user_error_is_one_line_once_and_exit_2_is_the_root_cause(tmp_path):
    result = torchrun(tmp_path, "optimizer.lr=nan")
    output = result.stdout + result.stderr
    line = f"error: {TOY}: [optimizer] lr: nan is not a finite number; allowed: a finite number"
    assert output.count(line) == 1, output
    # torchrun stops the other ranks once one exits: the first to fail (its "Root Cause") is
    # rank 0 with exit 2, the others exit 2 too or are stopped by torchrun (SIGTERM, -15).
    root_cause = output.split("Root Cause", 1)[1]
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 2 ", root_cause), output
    codes = re.findall(r"^\s+exitcode\s+: (-?\d+)", output, re.MULTILINE)
    assert len(codes) == 2 and set(codes) <= {"2", "-15"}, output
    assert "titan_learner/" not in output, "no traceback through the project's code"


FAILING_RANKS = """
import os, sys, time
from titan_learner.cli.common import user_error

rank = int(os.environ["RANK"])
if rank == 0 and sys.argv[1] == "rank-0-busy":
    time.sleep(60)  # e.g. in a collective, waiting for the rank that failed
sys.exit(user_error(ValueError(f"rank {rank} failed")))
"""


def failing_ranks(tmp_path: Path, case: str) -> tuple[str, float]:
    """Both ranks of a real torchrun end in the job's `user_error`, rank 0 at once or busy."""
    script = tmp_path / "failing_ranks.py"
    script.write_text(FAILING_RANKS)
    started = time.monotonic()
    result = subprocess.run(
        launcher("--standalone", str(script), case), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    return result.stdout + result.stderr, time.monotonic() - started


def test_the_one_error_line_is_rank_0s_unless_rank_0_is_slower_than_its_grace(tmp_path):
    """A rank that fails alone while rank 0 is busy prints its own line after the grace (torchrun
    then stops rank 0, which prints nothing); when both fail together only rank 0's is printed."""
    output, seconds = failing_ranks(tmp_path, "rank-0-busy")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1 failed"], output
    assert seconds < 45, f"the run waited for busy rank 0 ({seconds:.0f} s)"
    output, _ = failing_ranks(tmp_path, "together")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 0 failed"], output


def test_a_run_prints_no_launcher_noise(tmp_path):
    result = torchrun(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in result.stdout + result.stderr
    assert "Triton is installed" not in result.stdout + result.stderr


def test_a_worker_killed_mid_run_is_restarted_by_torchrun_and_the_run_ends_as_if_never_killed(
    tmp_path,
):
    """`torchrun --max-restarts 1`: rank 0 SIGKILLed after the step-4 checkpoint; torchrun stops
    rank 1 and restarts both with the same command, which resumes as --resume auto."""
    steps = 12
    job = [*toy_job(tmp_path / "whole", steps, 4), "--set", "parallelism.dp_shard=2"]
    whole = subprocess.run(
        launcher("--standalone", "-m", "titan_learner", *job), capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stdout + whole.stderr
    cut = tmp_path / "cut"
    job = [*toy_job(cut, steps, 4), "--set", "parallelism.dp_shard=2"]
    command = launcher("--standalone", "--max-restarts", "1", "-m", "titan_learner", *job)
    killed = kill_when(command, lambda: committed_step(cut) >= 4, lambda: lock_holder(cut))
    assert killed.returncode == 0, killed.output
    assert "torchrun restart 1: resuming as --resume auto" in killed.output
    host = socket.gethostname()
    assert (
        f"taking over the lock of pid {killed.pid} on {host} (no longer running)" in killed.output
    )
    assert [row["step"] for row in training_rows(cut)] == list(range(1, steps + 1))
    assert repeatable(cut) == repeatable(tmp_path / "whole")
    assert saved_state(cut, steps) == saved_state(tmp_path / "whole", steps)
