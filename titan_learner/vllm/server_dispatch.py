"""Which rollout server samples each prompt: the one with the fewest of this rank's prompts in
flight, so a server that finishes sooner takes more of the step's prompts.

A prompt's G samples stay together on one server (they share its prefix cache). Each rank
sends a server up to `SEQUENCES_IN_FLIGHT_PER_SERVER` sequences (prompts x G) at once: twice
the most vLLM 0.32 schedules at once by default (`max_num_seqs` 1024 on an H100 or H200, 256
on smaller GPUs and CPUs), so a server's batch stays full while answers travel, and the cap
grows with the servers, so a trainer of few ranks still fills many servers. While every
prompt of a step is in flight at once, the choice is round-robin from `first` (a rank's own
start); once the cap binds, a static round-robin would keep sending every other prompt to a
slow server while the fast one waits, and the step would end at the slow one's pace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

SEQUENCES_IN_FLIGHT_PER_SERVER = 2048

Result = TypeVar("Result")


class LeastLoaded:
    """The servers' counts of prompts in flight; `take` picks one, `done` gives it back."""

    def __init__(self, servers: int, first: int) -> None:
        self._in_flight = [0] * servers
        self._first = first % servers
        self._lock = threading.Lock()

    def take(self) -> int:
        """The server with the fewest prompts in flight; on a tie, the next from `first`."""
        servers = len(self._in_flight)
        with self._lock:
            chosen = min(
                range(servers),
                key=lambda s: (self._in_flight[s], (s - self._first) % servers),
            )
            self._in_flight[chosen] += 1
            return chosen

    def done(self, server: int) -> None:
        with self._lock:
            self._in_flight[server] -= 1


def prompts_in_flight(group_size: int) -> int:
    """How many prompts of `group_size` samples a rank keeps in flight on one server."""
    return max(1, SEQUENCES_IN_FLIGHT_PER_SERVER // group_size)


def sample_on_servers(
    prompts: int,
    servers: int,
    first: int,
    sample: Callable[[int, int], Result],
    in_flight_per_server: int,
) -> list[Result]:
    """`sample(prompt, server)` for every prompt, each on the least-loaded server as a thread
    frees; the results in prompt order. On the first error nothing more is sent (a dead
    server would otherwise fail every prompt still queued for it, each after its retries), and
    it raises once the sends in flight end."""
    load = LeastLoaded(servers, first)

    def on_least_loaded(prompt: int) -> Result:
        server = load.take()
        try:
            return sample(prompt, server)
        finally:
            load.done(server)

    with ThreadPoolExecutor(max(1, min(prompts, in_flight_per_server * servers))) as threads:
        futures = [threads.submit(on_least_loaded, prompt) for prompt in range(prompts)]
        finished, queued = wait(futures, return_when=FIRST_EXCEPTION)
        for future in queued:
            future.cancel()
        errors = [f.exception() for f in futures if f in finished and f.exception()]
        if errors:
            raise errors[0]  # the first prompt's that failed
        return [future.result() for future in futures]
