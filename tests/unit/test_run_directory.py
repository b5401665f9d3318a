"""A run owns its output directory: a live run's directory, a killed run's lock and a finished
run's files are never taken over or truncated without being asked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from titan_learner.config.errors import ConfigError
from titan_learner.job.run_directory import LOCK, RunDirectory


def holder(tmp_path, pid: int) -> None:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / LOCK).write_text(f"{pid} {socket.gethostname()}\n")


def test_a_run_takes_and_releases_the_lock(tmp_path):
    directory = RunDirectory(tmp_path / "run", "run.toml")
    assert directory.acquire(resume=False, overwrite=False) is None
    pid, host = (tmp_path / "run" / LOCK).read_text().split()
    assert (int(pid), host) == (os.getpid(), socket.gethostname())
    directory.release()
    assert not (tmp_path / "run" / LOCK).exists()


def test_a_second_run_into_a_live_directory_is_refused(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder(tmp_path, live.pid)
        with pytest.raises(ConfigError) as info:
            RunDirectory(tmp_path, "run.toml").acquire(resume=True, overwrite=False)
        assert str(info.value) == (
            f"run.toml: [run] output_dir: {tmp_path} is in use by pid {live.pid} on "
            f"{socket.gethostname()} (lock {tmp_path / LOCK}); allowed: wait for that run to end, "
            "or a new output_dir"
        )
    finally:
        live.kill()
        live.wait()


def test_a_killed_runs_lock_is_reported_not_taken(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    holder(tmp_path, int(dead.stdout))
    with pytest.raises(
        ConfigError, match=rf"left by pid {int(dead.stdout)}, which is no longer running"
    ):
        RunDirectory(tmp_path, "run.toml").acquire(resume=True, overwrite=False)
    assert (tmp_path / LOCK).exists()


def test_a_finished_run_is_never_truncated_and_overwrite_moves_it_aside(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as info:
        RunDirectory(run, "run.toml").acquire(resume=False, overwrite=False)
    assert str(info.value) == (
        f"run.toml: [run] output_dir: {run} holds a previous run (checkpoints, metrics.jsonl); "
        "allowed: --resume to continue it, --overwrite to move it aside first, or a new output_dir"
    )
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(ConfigError, match="but no committed checkpoint to resume from"):
        RunDirectory(run, "run.toml").acquire(resume=True, overwrite=False)
    (run / "checkpoints" / "latest").write_text("step-1\n")
    resumed = RunDirectory(run, "run.toml")
    assert resumed.acquire(resume=True, overwrite=False) is None  # a resumable run: continued
    resumed.release()
    aside = RunDirectory(run, "run.toml").acquire(resume=False, overwrite=True)
    assert aside is not None and aside.name.startswith("run.old-")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / "metrics.jsonl").exists()


def test_an_unwritable_output_dir_is_one_line_before_any_compute(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ConfigError, match=r"\[run\] output_dir: cannot write to .*file/run: Not a directory"
    ):
        RunDirectory(blocker / "run", "run.toml").acquire(resume=False, overwrite=False)
