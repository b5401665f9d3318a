"""On a CPU host, vLLM's processes wait for their next message by sleeping, not by spinning.

vLLM 0.32's shared-memory message queue (`shm_broadcast.SpinCondition`, between the engine core
and its workers) busy-waits with `sched_yield` for one second after every message before it
sleeps on its notification socket. On a GPU node that costs a spare core. On a CPU machine the
engine shares the trainer's cores: every rollout and every weight update leaves the worker and
the engine core spinning for a second, which is exactly when the trainer computes its update.
Measured on 2 cores, the embedded default's update took 1.0 s beside a vLLM server instead of
0.09 s (docs/performance.md). Upstream has an open change that makes the window configurable
(vllm-project/vllm#52814), not in 0.32; until then `register` (our plugin, loaded in every vLLM
process) caps it on CPU platforms. 2 ms keeps the spinning fast path between the steps of a
generation, and the engines sleep as soon as they are idle. GPU platforms keep vLLM's default.

A sleeping reader wakes on a notification the writer sends with each message, and vLLM knows
that one can be lost: it re-reads the queue every 5 s (`SHM_READER_RECHECK_INTERVAL_MS`). The
engine core sends two messages back to back at the start of every model step, and a reader
asleep then missed one notification in about one step of five, stalling the rollout 5 s.
Asleep, a capped reader therefore re-reads every IDLE_RECHECK_MS instead: 100 short wake-ups
a second, a lost notification costing at most 10 ms.
"""

from __future__ import annotations

BUSY_LOOP_S = 0.002
"""How long a message-queue reader on a CPU platform spins after a message before it sleeps."""
IDLE_RECHECK_MS = 10
"""How long it sleeps at most before it reads the queue again (a notification may be lost)."""


def cap_busy_wait() -> None:
    """On a CPU platform, every `SpinCondition` reader of this process (those made already
    included) spins at most BUSY_LOOP_S after a message, then sleeps IDLE_RECHECK_MS at a time
    (idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if getattr(original, "capped_busy_wait", False):
        return

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, BUSY_LOOP_S)
        original(self, IDLE_RECHECK_MS if timeout_ms is None else min(timeout_ms, IDLE_RECHECK_MS))

    wait.capped_busy_wait = True  # type: ignore[attr-defined]
    SpinCondition.wait = wait
