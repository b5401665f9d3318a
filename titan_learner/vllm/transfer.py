"""The trainer side of one engine's weight transfer, on vLLM's own RL API.

`EngineWeightTransfer` builds the trainer engine for a backend through vLLM's
`WeightTransferTrainerFactory` (our gloo backend registered first; `nccl`: vLLM's broadcast in
our checked round, joined from a secret, `nccl_rendezvous`; `ipc`: vLLM's IPC engine kept to
this rank and its engine's device, `ipc_trainer`), with a client that answers the four control
calls (a `vllm.LLM` does), and sends one export per `send(named, version)`.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch

from titan_learner.vllm.gloo_group import route_address
from titan_learner.vllm.ipc_trainer import local_ipc_trainer
from titan_learner.vllm.nccl_rendezvous import secret_nccl_trainer
from titan_learner.vllm.plugin import register
from titan_learner.vllm.sources import NamedTensorSource
from titan_learner.vllm.update_session import UpdateSession


def address_toward(url: str) -> str:
    """This machine's address on its route to `url`'s host: where a server there reaches the
    trainer's rendezvous for a weight broadcast (127.0.0.1 for a server on this machine)."""
    parts = urllib.parse.urlsplit(url)
    return route_address(parts.hostname or "localhost", parts.port or 80)


def trainer_init_info(backend: str, workers: int, address: str = "127.0.0.1") -> Any:
    """The trainer init info of `backend` for one sender and `workers` inference workers."""
    if backend == "gloo":
        from titan_learner.vllm.gloo_trainer import GlooTrainerInitInfo

        return GlooTrainerInitInfo(rank=0, world_size=1 + workers, master_address=address)
    raise ValueError(f"no trainer init info for weight transfer backend {backend!r}")


ENGINE_POLL_S = 0.5
"""How often a control call in flight asks whether its engine's process is still there."""


def engine_resources(llm: Any) -> Any:
    """vLLM's record of a `vllm.LLM`'s engine process (its `engine_dead` flag), or None for an
    engine that runs in this process."""
    return getattr(llm.llm_engine.engine_core, "resources", None)


class OfflineClient:
    """vLLM's four control calls on an in-process `vllm.LLM` (its RL mixin takes requests
    wrapped as `{"init_info": ...}` / `{"update_info": ...}`; trainer engines pass the info).

    Each call fails once the engine's process is gone: vLLM 0.32 never answers a call its
    engine core died after receiving (the client's future waits for good, and the job with
    it), so the call runs on a helper thread while this one watches vLLM's own dead-engine
    flag."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._while_alive(self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._while_alive(self.llm.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._while_alive(self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._while_alive(self.llm.finish_weight_update, weight_version)
        if self._while_alive(self.llm.reset_prefix_cache) is False:  # KV of the old weights
            raise RuntimeError(
                "the vLLM engine refused to reset its prefix cache after the weight update "
                "(blocks still held by requests in flight, which the job never leaves there "
                "during a push): its cached KV would be of the previous weights"
            )

    def _while_alive(self, call: Callable[..., Any], *args: Any) -> Any:
        resources = engine_resources(self.llm)
        if resources is None:  # the engine runs in this process: nothing to outlive
            return call(*args)
        if resources.engine_dead:
            raise self._gone(call)
        done, outcome = threading.Event(), {}

        def run() -> None:
            try:
                outcome["value"] = call(*args)
            except BaseException as err:
                outcome["error"] = err
            finally:
                done.set()

        threading.Thread(target=run, name="titan-learner-engine-call", daemon=True).start()
        while not done.wait(ENGINE_POLL_S):
            if resources.engine_dead:
                raise self._gone(call)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    @staticmethod
    def _gone(call: Callable[..., Any]) -> RuntimeError:
        return RuntimeError(
            f"the vLLM engine's process exited before its {call.__name__} call returned (its "
            "log above says why); the weights were not sent, and the run stops with its saved "
            "checkpoints as they are"
        )


class EngineWeightTransfer:
    """One engine's weights, sent through vLLM's trainer engine for `backend`."""

    def __init__(
        self,
        client: Any,
        backend: str,
        workers: int,
        address: str = "127.0.0.1",
        device: torch.device | None = None,
    ):
        """`address`: where the engine's workers reach this process's gloo rendezvous
        (`address_toward` a server on another machine); NCCL's bootstrap picks its own
        interface (`NCCL_SOCKET_IFNAME`). `device`: the GPU that `ipc` shares with the engine
        (None: the current CUDA device as this is built)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        register()
        checked = backend in ("gloo", "nccl")  # our checked rounds (`checked_round`)
        if checked and not hasattr(client, "abandon_weight_update"):
            client = UpdateSession(client)  # one engine's (a ServerGroup tracks each server's)
        self.backend = backend
        self.source = NamedTensorSource()
        if backend == "nccl":  # checked, joined from a secret (vllm.nccl_rendezvous)
            self.engine = secret_nccl_trainer(workers, client, self.source)
            return
        if backend == "ipc":  # vLLM's engine, kept to this rank (vllm.ipc_trainer)
            self.engine = local_ipc_trainer(client, self.source, device)
            return
        self.engine = WeightTransferTrainerFactory.trainer_init(
            trainer_init_info(backend, workers, address), client=client, source=self.source
        )

    def send(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.source.fill(named, version)
        try:
            self.engine.send_weights()
        finally:
            self.source.clear()

    def close(self) -> None:
        self.engine.shutdown()
