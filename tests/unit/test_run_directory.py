"""A run owns its output directory: a live run's directory and a finished run's files are
never taken over or truncated without being asked; a resuming run takes over the lock of a run
that is gone (a dead process on this host, a silent heartbeat from another)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_learner.config.errors import ConfigError
from titan_learner.job.run_directory import (
    AUTO,
    FINISHED,
    LOCK,
    Acquired,
    Holder,
    RunDirectory,
    mark_finished,
    start_ticks,
)

HOST = socket.gethostname()


def holder(tmp_path, pid: int, host: str = HOST, started="-", heartbeat=None) -> Holder:
    """A lock as a run of `pid` on `host` leaves it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    beat = time.time() if heartbeat is None else heartbeat
    (tmp_path / LOCK).write_text(f"{pid} {host} {started} {beat}\n")
    return Holder.read(tmp_path / LOCK)


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def acquire(directory: RunDirectory, resume=False, overwrite=False, steps=10):
    return directory.acquire(resume=resume, overwrite=overwrite, steps=steps)


def test_a_run_takes_and_releases_the_lock(tmp_path):
    directory = RunDirectory(tmp_path / "run", "run.toml")
    assert acquire(directory).moved is None
    lock = Holder.read(tmp_path / "run" / LOCK)
    assert (lock.pid, lock.host, lock.started) == (os.getpid(), HOST, start_ticks(os.getpid()))
    assert time.time() - lock.heartbeat < 60
    directory.release()
    assert not (tmp_path / "run" / LOCK).exists()


def test_a_second_run_into_a_live_directory_is_refused(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder(tmp_path, live.pid, started=start_ticks(live.pid))
        with pytest.raises(ConfigError) as info:
            acquire(RunDirectory(tmp_path, "run.toml"), resume=AUTO)
        assert str(info.value) == (
            f"run.toml: [run] output_dir: {tmp_path} is in use by pid {live.pid} on "
            f"{socket.gethostname()} (lock {tmp_path / LOCK}); allowed: wait for that run to end, "
            "or a new output_dir"
        )
    finally:
        live.kill()
        live.wait()


def test_a_killed_runs_lock_is_taken_over_by_a_resume_only(tmp_path):
    pid = dead_pid()
    left = holder(tmp_path, pid, started=12345)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-1\n")
    with pytest.raises(ConfigError) as info:
        acquire(RunDirectory(tmp_path, "run.toml"))
    assert str(info.value) == (
        f"run.toml: [run] output_dir: {tmp_path / LOCK} was left by pid {pid} on {HOST}, no "
        "longer running (a run that was killed); allowed: --resume (or --resume auto) to take "
        "it over, or a new output_dir"
    )
    assert Holder.read(tmp_path / LOCK) == left
    for resume in (True, AUTO):
        left = holder(tmp_path, pid, started=12345)
        directory = RunDirectory(tmp_path, "run.toml")
        assert acquire(directory, resume=resume).took_over == left
        assert Holder.read(tmp_path / LOCK).pid == os.getpid()
        directory.release()


def test_a_reused_pid_is_not_mistaken_for_the_run(tmp_path):
    """The pid runs again, but another process: its start time is not the lock's."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = holder(tmp_path, other.pid, started=start_ticks(other.pid) - 1)
        directory = RunDirectory(tmp_path, "run.toml")
        assert acquire(directory, resume=True).took_over == left
        directory.release()
    finally:
        other.kill()
        other.wait()


def test_a_run_that_died_unreaped_is_gone(tmp_path):
    """A zombie (exited, not yet waited for by its parent) keeps its pid but runs no more."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while "\nState:\tZ" not in Path(f"/proc/{child.pid}/status").read_text():
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
        left = holder(tmp_path, child.pid, started=start_ticks(child.pid))
        directory = RunDirectory(tmp_path, "run.toml")
        assert acquire(directory, resume=True).took_over == left
        directory.release()
    finally:
        child.wait()


def test_a_lock_from_another_host_is_taken_over_once_its_heartbeat_is_stale(tmp_path):
    fresh = time.time() - 290
    holder(tmp_path, 4242, host="node-7", started=99, heartbeat=fresh)
    with pytest.raises(ConfigError) as info:
        acquire(RunDirectory(tmp_path, "run.toml", stale_after_s=300), resume=AUTO)
    assert str(info.value) == (
        f"run.toml: [run] output_dir: {tmp_path} is in use by pid 4242 on node-7 (lock "
        f"{tmp_path / LOCK}); allowed: wait for that run to end, or a new output_dir"
    )
    stale = holder(tmp_path, 4242, host="node-7", started=99, heartbeat=time.time() - 310)
    directory = RunDirectory(tmp_path, "run.toml", stale_after_s=300)
    assert acquire(directory, resume=AUTO).took_over == stale
    directory.release()


def test_the_running_job_refreshes_its_heartbeat(tmp_path):
    directory = RunDirectory(tmp_path, "run.toml", stale_after_s=0.3)  # a beat every 0.1 s
    acquire(directory)
    first = Holder.read(tmp_path / LOCK).heartbeat
    deadline = time.monotonic() + 10
    while Holder.read(tmp_path / LOCK).heartbeat == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Holder.read(tmp_path / LOCK).heartbeat > first
    directory.release()
    assert not (tmp_path / LOCK).exists()


def test_a_run_whose_lock_was_taken_over_leaves_the_new_holders_lock(tmp_path):
    """A run that stalled past lock_stale_after_s and lost its lock neither beats over nor
    removes the lock of the run that took over."""
    directory = RunDirectory(tmp_path, "run.toml", stale_after_s=0.3)
    acquire(directory)
    successor = holder(tmp_path, 4242, host="node-7", started=99, heartbeat=1.0)
    time.sleep(0.5)  # several beats
    directory.release()
    assert Holder.read(tmp_path / LOCK) == successor


def test_resume_auto_starts_fresh_or_resumes_or_does_nothing(tmp_path):
    empty = RunDirectory(tmp_path / "empty", "run.toml")
    assert acquire(empty, resume=AUTO) == Acquired()
    empty.release()
    killed = tmp_path / "killed"  # its lock and first metrics, no checkpoint yet
    holder(killed, dead_pid())
    (killed / "metrics.jsonl").write_text('{"step": 1}\n')
    (killed / "checkpoints").mkdir()
    directory = RunDirectory(killed, "run.toml")
    assert acquire(directory, resume=AUTO).took_over is not None
    directory.release()
    with pytest.raises(ConfigError, match="but no committed checkpoint to resume from"):
        acquire(RunDirectory(killed, "run.toml"), resume=True)  # bare --resume: as before
    (killed / "checkpoints" / "latest").write_text("step-2\n")
    resumed = RunDirectory(killed, "run.toml")
    assert acquire(resumed, resume=AUTO).finished is None
    resumed.release()
    mark_finished(killed, 10)
    for resume in (AUTO, True):
        assert acquire(RunDirectory(killed, "run.toml"), resume=resume, steps=10).finished == 10
        assert not (killed / LOCK).exists(), "a finished run is not run again"
    more = RunDirectory(killed, "run.toml")
    assert acquire(more, resume=AUTO, steps=12).finished is None  # more steps: resumed
    more.release()
    (killed / "checkpoints" / "latest").unlink()
    with pytest.raises(ConfigError, match="but no committed checkpoint to resume from"):
        acquire(RunDirectory(killed, "run.toml"), resume=AUTO, steps=12)
    assert (killed / FINISHED).exists() and (killed / "metrics.jsonl").exists()


def test_a_run_that_stopped_before_its_first_step_is_started_over(tmp_path):
    """A crash at start (a bad reward, Ctrl-C while the model was built) leaves a lock, the
    config and an empty metrics file: the same command runs again, without --overwrite."""
    died = tmp_path / "died"
    holder(died, dead_pid())
    (died / "metrics.jsonl").write_text("")
    (died / "checkpoints").mkdir()  # created, nothing committed
    (died / "config.toml").write_text("[run]\n")
    directory = RunDirectory(died, "run.toml")
    acquired = acquire(directory)
    assert acquired.reused and acquired.took_over is not None and acquired.moved is None
    assert Holder.read(died / LOCK).pid == os.getpid()
    directory.release()
    (died / "metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.1}\n')  # one row: a run
    with pytest.raises(ConfigError, match="holds a previous run"):
        acquire(RunDirectory(died, "run.toml"))


def test_a_finished_run_is_never_truncated_and_overwrite_moves_it_aside(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as info:
        acquire(RunDirectory(run, "run.toml"))
    assert str(info.value) == (
        f"run.toml: [run] output_dir: {run} holds a previous run (checkpoints, metrics.jsonl); "
        "allowed: --resume to continue it, --overwrite to move it aside first, or a new output_dir"
    )
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(ConfigError, match="but no committed checkpoint to resume from"):
        acquire(RunDirectory(run, "run.toml"), resume=True)
    (run / "checkpoints" / "latest").write_text("step-1\n")
    resumed = RunDirectory(run, "run.toml")
    assert acquire(resumed, resume=True).moved is None  # a resumable run: continued
    resumed.release()
    aside = acquire(RunDirectory(run, "run.toml"), overwrite=True).moved
    assert aside is not None and aside.name.startswith("run.old-")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / "metrics.jsonl").exists()


def test_an_unwritable_output_dir_is_one_line_before_any_compute(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ConfigError, match=r"\[run\] output_dir: cannot write to .*file/run: Not a directory"
    ):
        acquire(RunDirectory(blocker / "run", "run.toml"))
