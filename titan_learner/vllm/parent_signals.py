"""A trainer's colocated vLLM engine stops when the trainer stops it, not on the job's SIGTERM.

Slurm signals every process of a job step (its cgroup), systemd every process of a unit, Ctrl-C
every process of the terminal's group. A trainer rank's engine core then gets the SIGTERM its
trainer takes as a preemption (finish the step, save, exit 0), and vLLM takes it as its own
shutdown: it aborts the requests in flight and exits, the step in progress fails
(`EngineDeadError`, or a weight update that then waits for good) and the checkpoint the SIGTERM
asked for is never written.

So the trainer holds its engine (`hold_engine`): a file, named to the engine core in its
environment, that exists from before the engine starts until the trainer lets it go
(`EngineHold.release`: its `close`, or at exit before vLLM's own shutdown runs). In that engine
core, SIGTERM and SIGINT go to vLLM's handler only once the hold is released or the trainer is
gone (the orphan guard's SIGTERM); before that they are dropped, with one line in the log. A
signal carries no sender here (CPython does not pass it to handlers, and a thread mask cannot
route it: native thread pools started before any code of ours takes signals too), so the hold
is what tells the trainer's own stop from the job's.

Where vLLM runs the workers as processes of their own (its multiprocessing executor: on CPU,
and tensor parallel on GPUs), the engine core holds them the same way, and releases them when
it stops (vLLM then terminates them, also after a failed start).

An engine core started otherwise (a `titan-learner serve` server, whose API server stops its
engine itself; someone else's `vllm.LLM`) keeps vLLM's handling.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from titan_learner.vllm.orphan_guard import ENGINE_CORE

HOLD_ENV = "TITAN_LEARNER_ENGINE_HOLD"
"""The hold file's path, in the environment the engine core inherits from its trainer."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)
HELD = (ENGINE_CORE, "VllmWorker")
"""The processes of a held engine: its engine core and, where vLLM runs them apart (its
multiprocessing executor: on CPU, and tensor parallel on GPUs), its workers."""
_held = False
_log = logging.getLogger("vllm.titan_learner")


class EngineHold:
    """A hold: a file that exists until `release` (idempotent). The engine processes started
    while its path is in the environment (`HOLD_ENV`) take SIGTERM and SIGINT only once it is
    gone, or once the process that started them is.

    A held process's own hold (`under`) is named after its holder's, which removes it too on
    release: an engine core that is SIGKILLed cannot remove its own. A holder that is
    SIGKILLed cannot release: the held process removes the hold as it stops, orphaned."""

    def __init__(self, under: Path | None = None) -> None:
        if under is None:
            name = f"titan-learner-engine-hold-{os.getpid()}-{uuid.uuid4().hex}"
            self.path = Path(tempfile.gettempdir()) / name
        else:
            self.path = under.with_name(f"{under.name}.{os.getpid()}")
        self.path.touch()
        # At exit, released before the held processes are stopped: atexit runs the newest
        # first (vLLM's finalizers were registered earlier), and multiprocessing's exit, which
        # terminates its daemon children (an engine core's workers), first runs finalizers of
        # priority >= 0 (its children exit through it, not through atexit).
        atexit.register(self.release)
        self._at_exit = multiprocessing.util.Finalize(None, self.release, exitpriority=100)

    def release(self) -> None:
        for held in self.path.parent.glob(f"{self.path.name}.*"):
            held.unlink(missing_ok=True)  # the held processes' own holds
        self.path.unlink(missing_ok=True)
        atexit.unregister(self.release)
        self._at_exit.cancel()  # no longer needed at exit: multiprocessing's registry forgets it


@contextmanager
def hold_engine() -> Iterator[EngineHold]:
    """Around `vllm.LLM(...)`: the engine core it starts is held until `release`."""
    hold = EngineHold()
    previous = os.environ.get(HOLD_ENV)
    os.environ[HOLD_ENV] = str(hold.path)
    try:
        yield hold
    except BaseException:
        hold.release()
        raise
    finally:
        if previous is None:
            os.environ.pop(HOLD_ENV, None)
        else:
            os.environ[HOLD_ENV] = previous


def take_signals_from_parent() -> None:
    """In an engine core or worker of an engine its trainer holds, wrap vLLM's SIGTERM and
    SIGINT handlers (idempotent; main thread only, after vLLM installed them); elsewhere
    nothing."""
    global _held
    path = os.environ.get(HOLD_ENV)
    if _held or not path or not multiprocessing.current_process().name.startswith(HELD):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    _held = True
    parent = os.getppid()  # the trainer, or the worker's engine core
    hold = Path(path)
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    # this process holds the processes it starts in turn (an engine core its workers) until it
    # stops itself: vLLM's terminate of its workers, at its shutdown or a failed start, works
    own = EngineHold(under=hold)
    os.environ[HOLD_ENV] = str(own.path)

    def handle(signum: int, frame: FrameType | None) -> None:
        if hold.exists() and os.getppid() == parent:
            _log.warning(
                "%s ignored: this engine stops when its trainer stops it",
                signal.Signals(signum).name,
            )
            return
        if os.getppid() != parent:
            hold.unlink(missing_ok=True)  # its holder is gone (SIGKILLed) and cannot
        own.release()
        handler = handlers[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in SIGNALS:
        signal.signal(signum, handle)
