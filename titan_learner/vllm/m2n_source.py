"""What vLLM's `nccl_m2n` trainer engine sends: each rank's Hugging Face-named shards.

vLLM's `M2NTrainerWeightTransferEngine` runs on every trainer rank and reshards each rank's
shard straight into the servers' tensor-parallel layout; its source says where the shards lie
(`M2NWeightSource`). vLLM's `DTensorModuleSource` reads the model's own parameters, under
TorchTitan's names and layouts; this source hands it `LocalShards` instead: Hugging Face names,
the serving dtype, Llama's q/k permutation applied.

Each send (one per server) iterates the shards afresh, one tensor at a time: vLLM's engine
queues each one's reshard as it comes, records its use on its stream and waits for the stream
only at the end (`M2NTrainerWeightTransferEngine._send`), so a tensor made for the send (cast,
gathered) is let go once the next one comes and its memory is reused only after its reshard
ran: no rank holds the whole model. Iterating gathers the tensors sent whole (collectives), in
`plans` order on every rank: every rank sends.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from vllm.distributed.weight_transfer.m2n_common import MAX_SOURCE_SHARDS, M2NMesh, M2NParamMeta
from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

from titan_learner.weights.local_shards import LocalShards


def local_shards(model: nn.Module, spec, dtype: torch.dtype, world_size: int) -> LocalShards:
    """The model's `LocalShards` within m2n's bound on the source shards one destination shard
    takes (vLLM's MAX_SOURCE_SHARDS)."""
    return LocalShards(model, spec, dtype, world_size, max_sources=MAX_SOURCE_SHARDS)


class ShardSource(M2NWeightSource):
    """`shards`' layout (fixed for the run) and, each time it is iterated, their tensors now."""

    def __init__(self, shards: LocalShards) -> None:
        self.shards = shards

    def mesh(self) -> M2NMesh:
        return M2NMesh(self.shards.mesh_dims, 0)  # the trainer's ranks come first

    def metadata(self) -> list[M2NParamMeta]:
        return [
            M2NParamMeta(plan.name, self.shards.dtype, plan.shape, plan.placements)
            for plan in self.shards.plans
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.shards)
