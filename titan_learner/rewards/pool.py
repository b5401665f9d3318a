"""A reward function over worker processes, each call timed out: an overrunning worker is killed.

Rule rewards (math-verify above all) are CPU-bound Python, so threads do not run them in
parallel; processes do. Workers are spawned (forking a process that holds torch's threads and a
gloo group is unsafe), started on first use and reused for every step. Each worker takes a
chunk of completions and sends one result per call; a call that has not answered `timeout_s`
after the previous one is marked timed out, its worker is killed and replaced, and the rest of
its chunk goes back in the queue: a hung call costs one worker, never the job.

A function is sent to the workers pickled, by reference; functions loaded from a file beside the
config live in a module of our own naming (rewards.loading), which each worker loads first.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from titan_learner.rewards.loading import FILE_MODULE_PREFIX
from titan_learner.user_code import load_module_file

Result = tuple[str, object]
_CHUNKS_PER_WORKER = 4
_MAX_CHUNK = 64
_START_TIMEOUT_S = 120.0


def picklable(function: Callable) -> bool:
    """Whether `function` can travel to a worker (a lambda or a closure cannot)."""
    try:
        pickle.dumps(function)
    except Exception:
        return False
    return True


def _module_files(function: Callable) -> list[tuple[str, str]]:
    """The reward files a worker must load before it can unpickle `function`."""
    target = getattr(function, "func", function)  # a functools.partial's function
    name = getattr(target, "__module__", None) or ""
    if name.startswith(FILE_MODULE_PREFIX) and name in sys.modules:
        return [(name, sys.modules[name].__file__)]
    return []


def _serve(conn: Connection, payload: bytes, files: list[tuple[str, str]]) -> None:
    """A worker: load the reward, then call it on each chunk it is sent until told to stop.

    The job owns the worker's life: it stops it, kills it past a timeout, and its end closes the
    pipe, which ends the worker too. Slurm signals every process of a job step, and Ctrl-C every
    process of the terminal's group: a worker that died of that SIGTERM would fail the step the
    job is finishing before it saves its checkpoint. So a worker takes SIGTERM from the job alone
    (multiprocessing's own at the job's exit: `_obey_only`) and ignores SIGINT. SIGTERM is blocked
    before the reward is loaded, so every thread the reward starts inherits the block (a thread
    that did not could take the signal, and its default action ends the process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_obey_only, args=(os.getppid(),), daemon=True).start()
    try:
        for module_name, path in files:
            load_module_file(module_name, path)
        function = pickle.loads(payload)
    except Exception as err:
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while (message := _next(conn)) is not None:
        start, items = message
        for offset, item in enumerate(items):
            try:
                result: Result = ("ok", function(*item))
            except Exception as err:
                result = ("raised", f"{type(err).__name__}: {err}")
            try:
                conn.send((start + offset, result))
            except Exception:  # a value that cannot be pickled back
                value = result[1]
                conn.send((start + offset, ("ok", f"<a {type(value).__name__}>")))


def _obey_only(job: int) -> None:
    """Ends the worker on a SIGTERM that process `job` sent; any other sender's is dropped."""
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != job:
        pass
    os._exit(0)


def _next(conn: Connection) -> tuple[int, list] | None:
    """The next chunk, or None: told to stop, or the job is gone (its end of the pipe closed)."""
    try:
        return conn.recv()
    except EOFError:
        return None


class _Worker:
    def __init__(self, context, payload: bytes, files: list[tuple[str, str]], name: str) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, payload, files), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self.chunk: list[int] = []  # [next index, end] of the chunk in flight, [] when idle
        self.deadline = 0.0

    def ready(self) -> None:
        if not self.conn.poll(_START_TIMEOUT_S):
            raise RuntimeError(f"a reward worker did not start within {_START_TIMEOUT_S:g} s")
        status, detail = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"a reward worker could not load the reward: {detail}")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RewardPool:
    """`run(items, timeout_s)`: `function(*item)` for every item, over `workers` processes."""

    def __init__(self, function: Callable, workers: int, name: str) -> None:
        self.payload = pickle.dumps(function)
        self.files = _module_files(function)
        self.size = workers
        self.name = name
        self.workers: list[_Worker] = []  # one list for the pool's life (the finalizer's)
        # a pool dropped without close() (a library user's) still stops its workers
        weakref.finalize(self, _stop_all, self.workers)
        # the job's rollout thread scores ahead while the main thread may score a restored step
        self.lock = threading.Lock()

    def _spawn(self) -> _Worker:
        context = multiprocessing.get_context("spawn")
        return _Worker(context, self.payload, self.files, f"reward-{self.name}")

    def start(self) -> None:
        if not self.workers:
            self.workers.extend(self._spawn() for _ in range(self.size))
            for worker in self.workers:
                worker.ready()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        fresh = self._spawn()
        fresh.ready()
        self.workers[self.workers.index(worker)] = fresh

    def run(self, items: Sequence[tuple], timeout_s: float) -> dict[int, Result]:
        with self.lock:
            return self._run(items, timeout_s)

    def _run(self, items: Sequence[tuple], timeout_s: float) -> dict[int, Result]:
        self.start()
        size = max(1, min(_MAX_CHUNK, -(-len(items) // (self.size * _CHUNKS_PER_WORKER))))
        queue = deque(
            (start, min(start + size, len(items))) for start in range(0, len(items), size)
        )
        results: dict[int, Result] = {}
        while queue or any(w.chunk for w in self.workers):
            self._dispatch(items, queue, timeout_s)
            self._collect(queue, results, timeout_s)
            self._expire(queue, results, timeout_s)
        return results

    def _dispatch(self, items: Sequence[tuple], queue: deque, timeout_s: float) -> None:
        """A chunk to each idle worker; its first call's clock starts now."""
        for worker in self.workers:
            if not worker.chunk and queue:
                start, end = queue.popleft()
                worker.conn.send((start, list(items[start:end])))
                worker.chunk, worker.deadline = [start, end], time.monotonic() + timeout_s

    def _collect(self, queue: deque, results: dict[int, Result], timeout_s: float) -> None:
        """The results that arrive before the nearest deadline; each restarts its worker's
        clock for the next call of its chunk."""
        busy = {w.conn: w for w in self.workers if w.chunk}
        nearest = min(w.deadline for w in busy.values())
        for conn in wait(list(busy), timeout=max(0.0, nearest - time.monotonic())):
            worker = busy[conn]
            try:
                index, result = conn.recv()
            except (EOFError, OSError):  # the worker died (os._exit, a crash in native code)
                worker.process.join()
                died = f"the worker process died (exit code {worker.process.exitcode})"
                self._lost(worker, queue, results, ("raised", died))
                continue
            results[index] = result
            worker.chunk[0], worker.deadline = index + 1, time.monotonic() + timeout_s
            if worker.chunk[0] == worker.chunk[1]:
                worker.chunk = []

    def _expire(self, queue: deque, results: dict[int, Result], timeout_s: float) -> None:
        """A worker whose call overran: the call timed out, the worker is replaced."""
        now = time.monotonic()
        for worker in list(self.workers):
            if worker.chunk and now > worker.deadline:
                late = ("timed out", f"no result after {timeout_s:g} s")
                self._lost(worker, queue, results, late)

    def _lost(
        self, worker: _Worker, queue: deque, results: dict[int, Result], result: Result
    ) -> None:
        """The call in flight on `worker` failed with `result`; the rest of its chunk is queued."""
        index, end = worker.chunk
        results[index] = result
        if index + 1 < end:
            queue.appendleft((index + 1, end))
        self._replace(worker)

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        _stop_all(self.workers)


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()
