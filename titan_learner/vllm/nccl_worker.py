"""The worker side of the `nccl` backend: vLLM's NCCL engine, checked before the swap.

vLLM's `NCCLWeightTransferEngine` loads each broadcast piece into the served model as it
arrives (layerwise reload), so bytes altered on the way would be served before anyone could
check them. This engine keeps vLLM's receive (its unique-id join, its packed broadcast, its
one-by-one fallback) but hands it a collector in place of the model: every piece is copied to
host memory as it lands, and the update is checked against the trainer's manifest and swapped
in like the gloo backend's (`checked_worker`). vLLM registers it as `nccl_checked`
(`plugin`); a server started for `weight_transfer = "nccl"` runs it (`backends`).

Its init info carries `checked_updates`, which vLLM's own NCCL engine does not take: a server
started with vLLM's plain `nccl` backend refuses the trainer's init request, naming the field,
before any broadcast could hang on a worker that expects a different round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from titan_learner.vllm.checked_worker import CheckedUpdates, Named
from titan_learner.vllm.update_wire import ManifestedUpdateInfo


@dataclass(kw_only=True)
class CheckedNCCLInitInfo(NCCLWeightTransferInitInfo):
    checked_updates: bool = True


class HostCopies:
    """Takes the place of the served model during vLLM's receive: each piece its
    `load_weights` is given (views into a reused receive buffer) is copied to host memory."""

    def __init__(self) -> None:
        self.named: Named = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        copies = [(name, tensor.to("cpu", copy=True)) for name, tensor in weights]
        self.named.extend(copies)
        return {name for name, _ in copies}


class CheckedNCCLWeightTransferEngine(CheckedUpdates, NCCLWeightTransferEngine):
    init_info_cls = CheckedNCCLInitInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._start_checking()

    def init_transfer_engine(self, init_info: CheckedNCCLInitInfo) -> None:
        """A trainer connecting again (a restarted job) replaces the last one's communicator:
        vLLM's engine would overwrite it and keep its GPU buffers and threads."""
        self.shutdown()
        super().init_transfer_engine(init_info)

    def _receive(self, update_info: ManifestedUpdateInfo) -> Named:
        """vLLM's receive, into host copies instead of the served model."""
        copies, served = HostCopies(), self.model
        self.model = copies
        try:
            NCCLWeightTransferEngine.receive_weights(
                self,
                NCCLWeightTransferUpdateInfo(
                    names=update_info.names,
                    dtype_names=update_info.dtype_names,
                    shapes=update_info.shapes,
                ),
            )
        finally:
            self.model = served
        return copies.named

    def shutdown(self) -> None:
        self._drop()
        super().shutdown()
