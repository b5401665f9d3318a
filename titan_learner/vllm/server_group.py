"""Several `vllm serve` servers as one weight-transfer client: one broadcast reaches them all.

vLLM's trainer engines drive one client; `ServerGroup` is that client for a list of servers. A
backend that builds one group (gloo, nccl) numbers the workers after the trainer's rank 0, so
each server's `rank_offset` is 1 + the workers of the servers before it. Each call goes to every
server at once: their workers meet the trainer inside the same collectives. Each server's
update session is tracked (`UpdateSession`): a round that fails on some servers ends the
sessions it left open on the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from titan_learner.vllm.server_client import ServerClient, ServerError, stuck_engines
from titan_learner.vllm.update_session import UpdateSession
from titan_learner.vllm.update_wire import is_announce


class ServerGroup:
    def __init__(self, servers: Sequence[ServerClient]) -> None:
        if not servers:
            raise ValueError("a server group needs at least one server")
        self.servers = list(servers)
        self.sessions = [UpdateSession(server) for server in self.servers]
        self.workers = [server.workers() for server in self.servers]

    def check_engines_answer(self) -> None:
        """ServerError naming every server whose engine does not answer a read in time
        (`ServerClient.check_engine_answers`), all asked at once: a server that died inside an
        nccl broadcast leaves the broadcast's other servers stuck in it too."""

        def error(server: ServerClient) -> ServerError | None:
            try:
                server.check_engine_answers()
            except ServerError as err:
                return err
            return None

        with ThreadPoolExecutor(len(self.servers)) as pool:
            errors = list(pool.map(error, self.servers))
        failed = [err for err in errors if err is not None]
        stuck = [
            s.url for s, err in zip(self.servers, errors, strict=True) if err and err.timed_out
        ]
        if len(stuck) > 1 and len(stuck) == len(failed):
            raise stuck_engines(stuck)
        if failed:
            raise failed[0]

    @property
    def total_workers(self) -> int:
        return sum(self.workers)

    def _on_every_server(
        self, call: Callable[[ServerClient, int], Any], *, wait_for_all: bool = True
    ) -> None:
        """Call every server concurrently; the first failure is raised once all returned, or,
        without `wait_for_all`, as soon as it happens (the others' calls run on)."""
        pool = ThreadPoolExecutor(len(self.servers))
        try:
            running = [pool.submit(call, s, i) for i, s in enumerate(self.servers)]
            for done in running if wait_for_all else as_completed(running):
                done.result()
        finally:
            pool.shutdown(wait=wait_for_all)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every server joins the trainer's group; a server that refuses is raised at once.
        (The others wait inside the group's init for peers that will not come, and would
        hold their answers until it gives up: gloo's timeout, or never on NCCL.)"""
        offsets = [1 + sum(self.workers[:i]) for i in range(len(self.servers))]
        self._on_every_server(
            lambda s, i: s.init_weight_transfer_engine({**init_info, "rank_offset": offsets[i]}),
            wait_for_all=False,
        )

    def start_weight_update(self) -> None:
        self._on_every_server(lambda _, i: self.sessions[i].start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        """An announce runs beside the trainer's broadcast, where the other servers' workers
        wait inside a collective that a failed server leaves unfinished (for good on NCCL):
        its first failure is raised at once (`stuck_send`). A manifest or an abandon waits for
        every server, so that what follows it (finish, abandon) comes after all of them."""
        self._on_every_server(
            lambda _, i: self.sessions[i].update_weights(update_info),
            wait_for_all=not is_announce(update_info),
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_every_server(lambda _, i: self.sessions[i].finish_weight_update(weight_version))

    def abandon_weight_update(self) -> None:
        """End the sessions a failed round left open on some servers (`UpdateSession`)."""
        self._on_every_server(lambda _, i: self.sessions[i].abandon_weight_update())

    def shutdown_weight_transfer_engine(self) -> None:
        """Release each server's side of the transfer (an NCCL communicator, a gloo group),
        which a server would otherwise keep until the next trainer connects; best effort: a
        server that is gone has nothing to release."""

        def release(server: ServerClient, _: int) -> None:
            with contextlib.suppress(ServerError):
                server.shutdown_weight_transfer_engine()

        self._on_every_server(release)

    def pause(self) -> None:
        self._on_every_server(lambda s, _: s.pause())

    def resume(self) -> None:
        self._on_every_server(lambda s, _: s.resume())

    def reset_prefix_cache(self) -> None:
        self._on_every_server(lambda s, _: s.reset_prefix_cache())
