"""The trainer side of the `nccl` backend: vLLM's NCCL trainer engine in a checked round.

vLLM's `NCCLTrainerWeightTransferEngine` broadcasts (packed, on its own streams); this engine
runs that broadcast inside our round (`checked_round`: announce, broadcast, manifest, finish
with the version) and hashes each tensor as the broadcast takes it, so the workers
(`nccl_worker`) can check what arrived before they swap it in. The hash needs each tensor in
host memory: one device-to-host copy of the export on rank 0 per update.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

from titan_learner.vllm.checked_round import send_checked
from titan_learner.weights.export import Checksum


class HashedSource(WeightSource):
    """The source's tensors, each added to `digest` as it is handed on."""

    def __init__(self, source: WeightSource, digest: Checksum) -> None:
        self.source, self.digest = source, digest

    def metadata(self) -> list[ParamMeta]:
        return self.source.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            self.digest.update(name, tensor)
            yield name, tensor


class CheckedNCCLTrainer(NCCLTrainerWeightTransferEngine):
    def send_weights(self) -> None:
        assert self.source is not None
        if torch.cuda.is_available():
            # The source holds the export, made on this stream; vLLM packs and hashes it on
            # streams of its own (packed_tensor), which do not wait for this one.
            torch.cuda.current_stream().synchronize()
        send_checked(
            self.client, self.source, self._broadcast, self.is_sender, channel="nccl broadcast"
        )
        self._post_send_sync()

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> str:  # type: ignore[override]
        """vLLM's broadcast of the source; the xxh3 checksum of what it sent."""
        digest = Checksum()
        super()._broadcast(HashedSource(source, digest), meta)
        return digest.hexdigest()
