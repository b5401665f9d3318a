"""The job under the real torchrun, as users launch it: a user error is one line, printed once
by rank 0, whose exit 2 is what torchrun reports as the root cause (torchrun then adds its own
report of the failed ranks, which the job cannot suppress); a run that succeeds prints none of
the launcher-level noise that a user cannot act on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"


def torchrun(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    overrides = [
        "parallelism.dp_shard=2",
        f'run.output_dir="{tmp_path / "run"}"',
        "run.steps=1",
        "eval.every_steps=0",
        "data.eval_files=[]",
        *sets,
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", "-m", "titan_learner", "train", "--config", str(TOY)]
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


def test_a_run_prints_no_launcher_noise(tmp_path):
    result = torchrun(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in result.stdout + result.stderr
    assert "Triton is installed" not in result.stdout + result.stderr
