"""The trainer side of `nccl_m2n`: vLLM's `M2NTrainerWeightTransferEngine`, one per server.

vLLM's m2n engine puts every trainer rank and one engine's workers in one NCCL communicator
(trainer ranks first, then the workers) and reshards each trainer rank's shard straight into
the workers' tensor-parallel layout: no rank gathers the model. vLLM 0.32's worker side numbers
its workers right after the trainer's ranks, so one communicator reaches one server; several
servers get one engine each, updated one after the other (each server receives the model once).

Each communicator is joined from an NCCL unique id that trainer rank 0 mints per init (as for
`nccl`: `nccl_rendezvous`) and hands the other trainer ranks over the trainer's own process
group; a server receives it only inside its guarded init request. Rank 0 alone drives the
servers' control routes; every rank runs every reshard.

Unlike gloo and nccl, no manifest is checked before the swap: vLLM writes each shard straight
into the served parameters. What vLLM checks at init: each tensor's dtype and rank, that its
layouts divide its shape, and m2n's fan-in and fan-out limits. Not names or shapes against the
served model: a tensor its workers cannot place (another name, a shape that does not fit) is
received whole for the model's `load_weights` (m2n_layout.resolve_parameter_destinations),
which fails inside the update while every trainer rank waits in the reshards. So
`ServerGenerator` checks the shards' names and whole shapes against the served model before it
asks any server anything (`check_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from titan_learner.vllm.m2n_source import ShardSource
from titan_learner.vllm.stuck_send import SendGuard


def m2n_init_info(
    rank: int, trainer_ranks: int, workers: int, tensor_parallel: int, unique_id_b64: str
) -> Any:
    """vLLM's trainer init info for one server of `workers` workers: its mesh is replicas x
    `tensor_parallel` (the shard axis vLLM's workers reshard into), or flat where that does
    not divide (vLLM then loads whole tensors through `load_weights`)."""
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

    per_replica = tensor_parallel if workers % tensor_parallel == 0 else 1
    return M2NTrainerInitInfo(
        rank=rank,
        world_size=trainer_ranks + workers,
        num_trainer_ranks=trainer_ranks,
        dst_mesh_dims=(workers // per_replica, per_replica),
        nccl_unique_id_b64=unique_id_b64,
    )


def minted_unique_ids(count: int) -> list[str]:
    """`count` fresh NCCL unique ids, minted on trainer rank 0 and the same on every rank (a
    collective over the trainer's process group)."""
    import torch.distributed as dist

    from titan_learner.ranks import is_distributed, rank
    from titan_learner.vllm.nccl_rendezvous import encoded, new_unique_id

    ids: list[Any] = [None]
    if rank() == 0:
        ids = [[encoded(new_unique_id()) for _ in range(count)]]
    if is_distributed():
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


class VersionedFinish:
    """A server's control routes for vLLM's m2n trainer engine, whose `finish_weight_update`
    names no version: this one names the version being sent, so the server reports it. Its
    `update_weights` runs on vLLM's thread beside every rank's reshards; a failure is also
    reported to `guard`, as those reshards cannot end without the server (`stuck_send`)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.version: int | None = None
        self.guard: SendGuard | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.server.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.server.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        try:
            self.server.update_weights(update_info)
        except BaseException as err:
            if self.guard is not None:
                self.guard.control_failed(err)
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.server.finish_weight_update(str(self.version))


class M2NTransfer:
    """Every trainer rank's shards to every server, through one vLLM m2n engine per server
    (`tensor_parallel`: each server's, as it reports it).

    A collective: every trainer rank builds it and calls `send` together (the job does, in
    step with training), and rank 0 alone talks to the servers.
    """

    def __init__(
        self,
        servers: Sequence[Any],
        workers: Sequence[int],
        source: ShardSource,
        *,
        rank: int,
        trainer_ranks: int,
        tensor_parallel: Sequence[int],
    ) -> None:
        from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerWeightTransferEngine

        self.source = source
        self.clients = [VersionedFinish(server) for server in servers]
        self.engines = []
        unique_ids = minted_unique_ids(len(servers))
        for client, count, tp, unique_id in zip(
            self.clients, workers, tensor_parallel, unique_ids, strict=True
        ):
            info = m2n_init_info(rank, trainer_ranks, count, tp, unique_id)
            self.engines.append(
                M2NTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
            )

    def send(self, version: int) -> None:
        """The source's shards to each server in turn (each send iterates them afresh)."""
        for client, engine in zip(self.clients, self.engines, strict=True):
            client.version = int(version)
            with SendGuard("the trainer's nccl_m2n reshard") as client.guard:
                engine.send_weights()

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
