"""One run owns its output directory: a lock while it runs, and no silent overwrite of another.

- A run takes `<output_dir>/.titan_learner.lock` (pid and host), created exclusively before
  the model is built; a second run into the same directory is refused while it is held. A lock
  left by a process that no longer runs is reported with its pid, never silently taken over.
- A run without --resume into a directory that holds a previous run (checkpoints or metrics)
  is refused: nothing of it is truncated or replaced; so is --resume when that run left no
  committed checkpoint (it would start over on top of its metrics). `--overwrite` moves the old
  run aside to `<output_dir>.old-<time>` first; nothing is deleted.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from titan_learner.checkpoint.layout import LATEST
from titan_learner.config.errors import ConfigError

LOCK = ".titan_learner.lock"
PREVIOUS_RUN = ("checkpoints", "metrics.jsonl")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _holder(lock: Path) -> tuple[int, str] | None:
    try:
        pid, host = lock.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None


class RunDirectory:
    """`acquire` on rank 0 before any compute; `release` when the run ends."""

    def __init__(self, output_dir: str | os.PathLike, source: str) -> None:
        self.path = Path(output_dir)
        self.source = source
        self.lock = self.path / LOCK
        self.held = False

    def _error(self, message: str) -> ConfigError:
        return ConfigError(message, source=self.source, where="[run] output_dir")

    def acquire(self, *, resume: bool, overwrite: bool) -> Path | None:
        """Own the directory; returns where a previous run was moved (--overwrite), if any."""
        self._check_lock()
        moved = None
        previous = [name for name in PREVIOUS_RUN if (self.path / name).exists()]
        resumable = (self.path / "checkpoints" / LATEST).exists()
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
            self._check_lock()  # another run took it between our check and our create
            raise
        except OSError as err:
            raise self._error(f"cannot write to {self.path}: {err.strerror}") from None
        with os.fdopen(fd, "w") as file:
            file.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.held = True
        return moved

    def _check_lock(self) -> None:
        if not self.lock.exists():
            return
        holder = _holder(self.lock)
        if holder is None:
            raise self._error(
                f"{self.lock} exists but names no process; remove it if no run uses {self.path}"
            )
        pid, host = holder
        if host == socket.gethostname() and not _alive(pid):
            raise self._error(
                f"{self.lock} was left by pid {pid}, which is no longer running (a run that was "
                f"killed); remove the lock file to use {self.path}, or choose a new output_dir"
            )
        raise self._error(
            f"{self.path} is in use by pid {pid} on {host} (lock {self.lock}); allowed: wait for "
            "that run to end, or a new output_dir"
        )

    def release(self) -> None:
        if self.held:
            try:
                self.lock.unlink()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    raise
            self.held = False
