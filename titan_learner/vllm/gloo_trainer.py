"""The trainer side of the `gloo` weight-transfer backend: vLLM's `TrainerWeightTransferEngine`.

The same round trip as vLLM's NCCL trainer engine, over gloo: rank 0 opens a TCPStore, the
inference workers join it (`init_weight_transfer_engine`, in another thread while rank 0
builds its end of the group), and each `send_weights()` is one checked round
(`checked_round`): the tensors go out over gloo from host memory, hashed as they are sent.
"""

from __future__ import annotations

import datetime
import secrets
import threading
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from titan_learner.vllm.checked_round import send_checked
from titan_learner.vllm.gloo_group import bound_group
from titan_learner.vllm.gloo_wire import DEFAULT_TIMEOUT_S, GlooInitInfo
from titan_learner.weights.export import Checksum
from titan_learner.weights.matching import WeightsError


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """`world_size`: 1 (this sender) + every inference worker. `master_port` 0 takes a free
    port; `master_address` is where the workers reach this process."""

    backend: ClassVar[str] = "gloo"

    world_size: int
    master_address: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S


def open_group(init_info: GlooTrainerInitInfo, client: VLLMWeightSyncClient) -> Any:
    """Rank 0 of a new gloo group that the client's workers join."""
    timeout = datetime.timedelta(seconds=init_info.timeout_s)
    store = dist.TCPStore(
        init_info.master_address,
        init_info.master_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
    )
    worker_info = GlooInitInfo(
        master_address=init_info.master_address,
        master_port=store.port,
        world_size=init_info.world_size,
        secret=secrets.token_hex(16),
        timeout_s=init_info.timeout_s,
    )
    group_store = dist.PrefixStore(worker_info.secret, store)
    built: dict[str, Any] = {}

    def build() -> None:  # blocks until every worker has joined
        try:
            built["group"] = bound_group(
                group_store, 0, init_info.world_size, timeout, init_info.master_address
            )
        except BaseException as err:
            built["error"] = err

    # A daemon thread: if the workers never come, the client's error is raised at once and
    # this thread waits out its timeout without holding up the interpreter's exit.
    builder = threading.Thread(target=build, name="gloo-weight-transfer-init", daemon=True)
    builder.start()
    client.init_weight_transfer_engine(asdict(worker_info))
    builder.join(init_info.timeout_s)
    if "group" not in built:
        raise WeightsError(
            f"the inference workers did not join the gloo weight-transfer group at "
            f"{init_info.master_address}:{store.port}: {built.get('error', 'timed out')}"
        )
    return built["group"]


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            engine.group = open_group(init_info, client)
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        send_checked(
            self.client, self.source, self._broadcast, self.is_sender, channel="gloo broadcast"
        )

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> str:
        """Broadcast each tensor from rank 0, hashing what is sent; the xxh3 of it all. The
        source must yield what its metadata() declared, checked as vLLM's NCCL trainer
        engine checks it (its own `_checked_iter`)."""
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        digest = Checksum()
        for name, tensor in NCCLTrainerWeightTransferEngine._checked_iter(source, meta):
            host = tensor.detach().to("cpu").contiguous()
            self.group.broadcast(host, 0).wait()
            digest.update(name, host)
        return digest.hexdigest()

    def shutdown(self) -> None:
        self.group = None  # the group and its store close when collected
