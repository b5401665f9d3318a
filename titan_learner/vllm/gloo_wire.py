"""Where a worker joins the gloo backend's group (the update itself: `update_wire`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where a worker joins the trainer's gloo group: the trainer's TCPStore, the group's size
    (1 trainer + every worker), the first worker rank (workers follow the trainer's rank 0),
    and the secret of this rendezvous: the group's keys live under it in the store, so a peer
    that reaches the store's port without it finds no group to join and cannot take a rank.
    It is made per init and travels only on the (guarded) control route."""

    master_address: str
    master_port: int
    world_size: int
    secret: str = field(repr=False)
    rank_offset: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
