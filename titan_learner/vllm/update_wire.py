"""What the two sides of our checked backends (gloo, nccl) tell each other per update.

Plain dicts on the (guarded) control routes. Each update is two `update_weights` calls between
`start_weight_update` and `finish_weight_update`: the first announces the tensors (names,
dtypes, shapes, version) that then follow on the data channel; the second carries the manifest
of what was sent (the same fields plus the xxh3 checksum of the bytes), and the workers check
what they received against it before anything is swapped in. The manifest travels on the
control route, not on the data channel it vouches for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo


@dataclass
class ManifestedUpdateInfo(WeightTransferUpdateInfo):
    """One export's tensors, in broadcast order. Without `checksum`: they follow on the
    broadcast. With it: the manifest of what was broadcast, checked before the swap.
    `abandoned`: the trainer ends the session without an update (`update_session`)."""

    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    checksum: str | None = field(default=None)
    abandoned: bool = field(default=False)

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"update info: {len(self.names)} names, {len(self.dtype_names)} dtype names and "
                f"{len(self.shapes)} shapes; they describe the same tensors, one entry each"
            )
        unknown = sorted({d for d in self.dtype_names if not _is_dtype(d)})
        if unknown:
            raise ValueError(f"update info: unknown dtype names {unknown}")


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def abandoned_update() -> dict:
    """The update that ends a session the trainer will not finish: the workers refuse it
    before reading their data channel, and vLLM ends a session whose update raised."""
    return asdict(
        ManifestedUpdateInfo(version=-1, names=[], dtype_names=[], shapes=[], abandoned=True)
    )


def is_announce(update_info: dict) -> bool:
    """Whether this update announces tensors that follow on the data channel (rather than a
    manifest or an abandon): the call that runs beside the trainer's broadcast."""
    return update_info.get("checksum") is None and not update_info.get("abandoned", False)
