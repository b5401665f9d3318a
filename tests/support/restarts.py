"""Killing a real job the way an OOM killer or a lost node does, and reading what it left.

The job runs as users launch it (`python -m titan_learner train`, or torchrun), in a process
of its own; the test waits for a file the job writes (a metrics row, a committed checkpoint)
and sends SIGKILL: no grace, no cleanup, the lock and any half-written save left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_learner.checkpoint.layout import latest
from titan_learner.job.run_directory import LOCK, Holder

ROOT = Path(__file__).parents[2]
TOY = ROOT / "configs" / "toy_grpo.toml"
# Wall-clock and memory readings differ between any two runs; everything else must not.
UNREPEATABLE = ("_s", "tokens_per_s", "peak_memory_gib")


def toy_job(output_dir: Path, steps: int, interval: int, *sets: str) -> list[str]:
    """`train` arguments of the embedded default, small: 16 prompts x 8 completions a step."""
    overrides = [
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        "eval.every_steps=0",
        "eval.max_prompts=16",
        "run.log_samples_every=1",
        f"checkpoint.interval={interval}",
        f"run.steps={steps}",
        f'run.output_dir="{output_dir}"',
        *sets,
    ]
    return ["train", "--config", str(TOY), *[a for o in overrides for a in ("--set", o)]]


def job(*args: str) -> list[str]:
    """The command line of `python -m titan_learner ARGS`."""
    return [sys.executable, "-m", "titan_learner", *args]


def train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(job(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@dataclass(frozen=True)
class Killed:
    pid: int  # the process that was sent SIGKILL
    returncode: int  # of the command: -9 when it was that process, torchrun's own otherwise
    output: str  # stdout and stderr


def kill_when(command: list[str], ready: Callable[[], bool], victim: Callable[[], int]) -> Killed:
    """Run `command`; SIGKILL the pid `victim()` names once `ready()`, then wait for it to end.

    Fails if the job ends first (it would not have been killed mid-run).
    """
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while not ready():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the job ended before it was killed:\n{process.stdout.read()}"
                )
            time.sleep(0.01)
        pid = victim()
        os.kill(pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Killed(pid, process.returncode, output)


def lock_holder(output_dir: Path) -> int:
    """The pid in the run's lock: the process, or torchrun's rank 0, that runs the job."""
    holder = Holder.read(output_dir / LOCK)
    assert holder is not None, "the job runs but holds no lock"
    return holder.pid


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_rows(output_dir: Path) -> list[dict]:
    return [r for r in records(output_dir / "metrics.jsonl") if "training/reward_mean" in r]


def repeatable(output_dir: Path) -> list[dict]:
    """Every metrics row (training and eval), without wall-clock and memory readings."""
    return [
        {key: value for key, value in row.items() if not key.endswith(UNREPEATABLE)}
        for row in records(output_dir / "metrics.jsonl")
    ]


def committed_step(output_dir: Path) -> int:
    found = latest(output_dir / "checkpoints")
    return 0 if found is None else int(found.name.removeprefix("step-"))


def tensorboard_points(output_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every point TensorBoard shows for `tag` (purged points left out)."""
    board = EventAccumulator(str(output_dir / "tensorboard"))
    board.Reload()
    return [(event.step, event.value) for event in board.Scalars(tag)]


def saved_state(output_dir: Path, step: int) -> dict:
    """The xxh3 digests of every record a checkpoint holds (weights, optimizer moments, RNG,
    data position), by file and offset: equal digests, byte-equal training state."""
    checksums = output_dir / "checkpoints" / f"step-{step}" / "checksums.json"
    return json.loads(checksums.read_text())["records"]
