"""vLLM's engine core exits when the process that started it dies, SIGKILL included.

vLLM 0.32's engine core outlives a parent killed without its shutdown path (SIGKILL, the OOM
killer, a crash): a `vllm serve` API server, a trainer rank holding a colocated `vllm.LLM`. It
keeps its model, KV cache and workers (GPU memory on a GPU node), so the server or rank
restarted in its place finds the memory taken and fails to start, with no hint of the orphan
(upstream vllm-project/vllm#55510; its fixes, #55846 and #34816, are still open). Its workers
already exit with it: vLLM gives each a pipe that closes when the engine core dies.

Until the fix lands, `register` (our plugin, loaded in every vLLM process) starts a watch in
each engine core process: once its parent is gone (the engine core has been handed to another
parent), it sends itself SIGTERM, which vLLM handles as a clean shutdown, workers included,
and SIGKILL if that has not ended it within SHUTDOWN_GRACE_S (an engine stuck in a collective).
Polling the parent's pid, not the pipe multiprocessing keeps to it: under fork, a sibling
process that inherited the pipe's other end would keep it open after the parent died.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

PARENT_POLL_S = 1.0
"""How often the watch asks whether the engine core's parent is still its parent."""
SHUTDOWN_GRACE_S = 60.0
"""How long vLLM's own shutdown may take after the SIGTERM before the engine core is killed."""
ENGINE_CORE = "EngineCore"
"""vLLM names its engine core processes EngineCore, or EngineCore_DP<i> with data parallel."""

_watching = False


def exit_with_parent() -> None:
    """In an engine core process, start the watch (idempotent); elsewhere nothing: an API
    server or a trainer is the user's own process, which may outlive its shell."""
    global _watching
    if _watching or not multiprocessing.current_process().name.startswith(ENGINE_CORE):
        return
    _watching = True
    started_by = multiprocessing.parent_process()  # None if not started by multiprocessing
    parent = os.getppid() if started_by is None else started_by.pid  # gone already: at once
    threading.Thread(
        target=_watch, args=(parent,), name="titan-learner-exit-with-parent", daemon=True
    ).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
