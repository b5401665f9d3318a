"""Stopping a job whose weight send can no longer end: the engines' side of the update failed
while the trainer still sends to them.

An update runs the engines' `update_weights` (a control call, on a thread) beside the trainer's
send on the data channel. Where the engines' side fails (a server died; a worker refused the
update before it joined the transfer), the send waits for peers that will not come. gloo gives
up after its timeout; vLLM's NCCL communicators (nccl, nccl_m2n) have none, so every trainer
rank would wait for good, holding its GPU, and the job would never report why.

`SendGuard` watches the control call. Once it has failed, the send gets `GRACE_S` to end on its
own (gloo notices a dead peer at once and raises, and the job reports the error as usual). A
send still running after that cannot end: this process prints the control call's error as the
job's one line and exits with code 2, as `train` does for any user error, and torchrun then
stops the other ranks. Nothing saved is lost: a checkpoint is committed by a rename
(`checkpoint.layout`) and metrics.jsonl is flushed line by line, so the same command with
`--resume` continues from the last checkpoint once the server is back.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

GRACE_S = 30.0
"""How long a send may still run after the engines' side failed before it is taken as stuck:
a send that can end (gloo, a dead peer) raises within a second."""
EXIT_CODE = 2
"""As `train` exits for any user error (`cli.common.USER_ERROR`)."""


class StuckSendError(RuntimeError):
    """The engines' side of an update failed and the trainer's send cannot end."""


def stop_job(err: StuckSendError) -> None:
    """The job's one error line, then exit: only exiting ends a thread that waits inside an
    NCCL call. Trainer rank 0 alone drives the control calls, so it alone stops here, and its
    line needs no claim among ranks (`cli.common.user_error`)."""
    sys.stdout.flush()
    print(f"error: {err}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class SendGuard:
    """`with SendGuard(what):` around an update's control call and data-channel send;
    `control_done` (a Future callback) or `control_failed` reports the control call's end.
    `what` names the send in the error line (e.g. "the nccl broadcast")."""

    def __init__(
        self,
        what: str,
        *,
        grace_s: float | None = None,
        stop: Callable[[StuckSendError], Any] | None = None,
    ) -> None:
        """`grace_s`, `stop`: GRACE_S and stop_job unless given."""
        self.what = what
        self.grace_s = GRACE_S if grace_s is None else grace_s
        self.stop = stop_job if stop is None else stop
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._armed = False

    def __enter__(self) -> SendGuard:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._ended.set()

    def control_done(self, future: Future[Any]) -> None:
        err = None if future.cancelled() else future.exception()
        if err is not None:
            self.control_failed(err)

    def control_failed(self, err: BaseException) -> None:
        """From the control call's thread: the send now has `grace_s` to end."""
        with self._lock:
            if self._armed or self._ended.is_set():
                return
            self._armed = True
        threading.Thread(
            target=self._stop_if_stuck, args=(err,), name="stuck-send-guard", daemon=True
        ).start()

    def _stop_if_stuck(self, err: BaseException) -> None:
        if self._ended.wait(self.grace_s):
            return
        self.stop(
            StuckSendError(
                f"{err}; {self.what} waits for it and cannot end (no timeout), so the job "
                f"stops here, its last checkpoint unchanged: restart that server (or fix what "
                f"it refused), then run the same command with --resume"
            )
        )
