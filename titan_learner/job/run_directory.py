"""One run owns its output directory: a lock while it runs, and no silent overwrite of another.

- A run takes `<output_dir>/.titan_learner.lock` (pid, host, the process's start time and a
  heartbeat the run refreshes), created exclusively before the model is built; a second run into
  the same directory is refused while the holder lives. A resuming run takes over the lock of a
  run that is gone, so a crashed run continues with the command that started it: on the same
  host, when its pid no longer runs that process (the start time tells a reused pid apart); on
  another host, when its heartbeat is older than `[run] lock_stale_after_s`.
- A run without --resume into a directory that holds a previous run (a committed checkpoint or
  a metrics row; a run that stopped before its first step left neither and is started over,
  saying so) is refused: nothing of it is truncated or replaced; so is --resume when that run left no
  committed checkpoint (it would start over on top of its metrics). `--resume auto` resumes
  when there is a committed checkpoint and starts fresh when there is none (replacing the logs
  of a run killed before its first one). `--overwrite` moves the old run aside to
  `<output_dir>.old-<time>` first; nothing is deleted.
- A run that did all its steps writes `finished.json`: resuming it again does nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from titan_learner.checkpoint.layout import LATEST
from titan_learner.config.errors import ConfigError
from titan_learner.files import atomic_write_text

LOCK = ".titan_learner.lock"
FINISHED = "finished.json"
PREVIOUS_RUN = ("checkpoints", "metrics.jsonl")
AUTO = "auto"
HEARTBEAT_EVERY_S = 30.0

Resume = bool | Literal["auto"]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot): fields 3 and 22 of /proc/PID/stat, or
    None when there is no entry to read (no such process, no procfs, or one that hides it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when unknown."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """What a lock file says: `pid host start_ticks heartbeat` on one line."""

    pid: int
    host: str
    started: int | None  # start_ticks(pid) when it took the lock (None: not recorded)
    heartbeat: float | None  # time.time() of its last refresh (None: not recorded)

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), start_ticks(pid), time.time())

    @classmethod
    def read(cls, lock: Path) -> Holder | None:
        try:
            fields = lock.read_text().split()
            pid, host = int(fields[0]), fields[1]
            started = int(fields[2]) if len(fields) > 2 and fields[2] != "-" else None
            heartbeat = float(fields[3]) if len(fields) > 3 else None
        except (OSError, ValueError, IndexError):
            return None
        return cls(pid, host, started, heartbeat)

    def line(self) -> str:
        started = "-" if self.started is None else str(self.started)
        return f"{self.pid} {self.host} {started} {self.heartbeat!r}\n"

    def running(self) -> bool:
        """On this host: the pid runs (a zombie has finished), and is the same process (its
        start time). Without a /proc entry to read (another OS, a procfs hiding other users'
        processes) the pid alone decides, erring towards a live run."""
        stat = _proc_stat(self.pid)
        if stat is None:
            return _pid_exists(self.pid)
        state, started = stat
        return state not in ("Z", "X") and self.started in (None, started)

    def same_run(self, other: Holder | None) -> bool:
        """Whether `other` names the same process, whatever its heartbeat."""
        return other is not None and replace(other, heartbeat=self.heartbeat) == self

    def silent_for(self, lock: Path) -> float:
        """Seconds since its last heartbeat (the file's mtime when it recorded none)."""
        beat = self.heartbeat if self.heartbeat is not None else lock.stat().st_mtime
        return time.time() - beat


@dataclass(frozen=True)
class Acquired:
    """What `acquire` found: where a previous run was moved (--overwrite), whose lock it took
    over, and the step a finished run reached (then it holds no lock: nothing to do)."""

    moved: Path | None = None
    took_over: Holder | None = None
    finished: int | None = None
    reused: bool = False  # it held a run that stopped before its first step


def no_rows(output_dir: Path) -> bool:
    """Whether a run in `output_dir` logged no metrics row (it stopped before its first step
    or evaluation: a crash at start, a bad reward, Ctrl-C while the model was built)."""
    try:
        return not (output_dir / "metrics.jsonl").read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return True


def finished_step(output_dir: Path) -> int | None:
    """The step a run in `output_dir` finished at (`mark_finished`), or None."""
    try:
        return int(json.loads((output_dir / FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_finished(output_dir: Path, step: int) -> None:
    """Rank 0, when the run did all its steps: a later resume of it has nothing to do."""
    atomic_write_text(output_dir / FINISHED, json.dumps({"step": step}) + "\n")


def elastic_restarts() -> int:
    """How many times torchrun has restarted this worker group (0: the first launch)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class RunDirectory:
    """`acquire` on rank 0 before any compute; `release` when the run ends."""

    def __init__(
        self, output_dir: str | os.PathLike, source: str, stale_after_s: float = 300.0
    ) -> None:
        self.path = Path(output_dir)
        self.source = source
        self.lock = self.path / LOCK
        self.stale_after_s = stale_after_s
        self.held: Holder | None = None
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def _error(self, message: str) -> ConfigError:
        return ConfigError(message, source=self.source, where="[run] output_dir")

    def acquire(self, *, resume: Resume, overwrite: bool, steps: int) -> Acquired:
        """Own the directory, or say that its run already finished `steps` (when resuming)."""
        finished = finished_step(self.path)
        resumable = (self.path / "checkpoints" / LATEST).exists()
        started = resumable or finished is not None or not no_rows(self.path)
        # the lock of a gone run that left nothing to keep is taken over without being asked
        took_over = self._check_lock(take_over=bool(resume) or overwrite or not started)
        if resume and finished is not None and finished >= steps:
            return Acquired(took_over=took_over, finished=finished)
        moved = None
        previous = [name for name in PREVIOUS_RUN if (self.path / name).exists()]
        reused = bool(previous) and not started
        if reused or (resume == AUTO and not resumable and finished is None):
            previous = []  # a run killed before its first step, or checkpoint: start it over
        if previous and not (resume and resumable):  # a resumable run is continued, not replaced
            if overwrite:
                moved = self.path.with_name(
                    f"{self.path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
                )
                os.replace(self.path, moved)
            elif resume:
                raise self._error(
                    f"{self.path} holds a previous run ({', '.join(previous)}) but no committed "
                    "checkpoint to resume from; starting over would replace its metrics. "
                    "Allowed: --overwrite to move it aside first, or a new output_dir"
                )
            else:
                raise self._error(
                    f"{self.path} holds a previous run ({', '.join(previous)}); allowed: --resume "
                    "to continue it, --overwrite to move it aside first, or a new output_dir"
                )
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._check_lock(take_over=False)  # another run took it between check and create
            raise
        except OSError as err:
            raise self._error(f"cannot write to {self.path}: {err.strerror}") from None
        self.held = Holder.me()
        with os.fdopen(fd, "w") as file:
            file.write(self.held.line())
        self._beating = threading.Thread(target=self._beat, name="lock-heartbeat", daemon=True)
        self._beating.start()
        return Acquired(moved=moved, took_over=took_over, reused=reused)

    def _check_lock(self, take_over: bool) -> Holder | None:
        """Raise while a live run holds the lock; remove a gone run's lock when `take_over`
        (returning its holder)."""
        if not self.lock.exists():
            return None
        holder = Holder.read(self.lock)
        if holder is None:
            raise self._error(
                f"{self.lock} exists but names no process; remove it if no run uses {self.path}"
            )
        if holder.host == socket.gethostname():
            gone, why = not holder.running(), "no longer running (a run that was killed)"
        else:
            silent = holder.silent_for(self.lock)
            gone = silent > self.stale_after_s
            why = f"no heartbeat for {silent:.0f} s > [run] lock_stale_after_s"
        if gone and take_over:
            self._remove_lock_of(holder)
            return holder
        if gone:
            raise self._error(
                f"{self.lock} was left by pid {holder.pid} on {holder.host}, {why}; allowed: "
                "--resume (or --resume auto) to take it over, or a new output_dir"
            )
        raise self._error(
            f"{self.path} is in use by pid {holder.pid} on {holder.host} (lock {self.lock}); "
            "allowed: wait for that run to end, or a new output_dir"
        )

    def _remove_lock_of(self, holder: Holder) -> None:
        """Remove the lock if it is still `holder`'s: of several runs taking over one lock, only
        the first renames it away; a later one finds the winner's lock, puts it back, refuses."""
        grave = self.lock.with_name(f"{LOCK}.{os.getpid()}.stale")
        try:
            os.rename(self.lock, grave)
        except FileNotFoundError:
            return  # already removed: the exclusive create decides who runs
        if Holder.read(grave) == holder:
            grave.unlink()
            return
        try:
            os.link(grave, self.lock)
        except FileExistsError:
            pass
        finally:
            grave.unlink()
        raise self._error(
            f"another run took over {self.lock} at the same time; allowed: one run per output_dir"
        )

    def _beat(self) -> None:
        """Refresh the heartbeat while the run lives (a daemon thread: it dies with the run).
        A lock that is no longer ours (taken over while we stalled) is left alone."""
        every = min(HEARTBEAT_EVERY_S, self.stale_after_s / 3)
        while not self._stop.wait(every):
            held = self.held
            if held is None or not held.same_run(Holder.read(self.lock)):
                return
            try:
                atomic_write_text(self.lock, replace(held, heartbeat=time.time()).line())
            except OSError:
                continue  # a full disk or a network filesystem's hiccup: the next beat retries

    def release(self) -> None:
        if self._beating is not None:
            self._stop.set()
            self._beating.join()
            self._beating = None
        if self.held is not None:
            if self.held.same_run(Holder.read(self.lock)):  # not a run that took over from us
                self.lock.unlink(missing_ok=True)
            self.held = None
