"""What the trainer side sends: a vLLM `WeightSource` that also says which policy version it is.

vLLM's trainer engines replay their source on every `send_weights()`. `NamedTensorSource` holds
one verified export (what `GeneratorSink` hands a generator) and is refilled before each send;
its `version` travels with the update so the engine reports the version it serves.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class NamedTensorSource(WeightSource):
    """A list of `(hf_name, tensor)` and its policy version, sent as they are (no gather)."""

    def __init__(self) -> None:
        self.named: list[tuple[str, torch.Tensor]] = []
        self.version = 0

    def fill(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.named, self.version = named, int(version)

    def clear(self) -> None:
        self.named = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.named]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self.named))
