"""Which process this is, with or without a process group (a plain `python` run is rank 0 of 1)."""

from __future__ import annotations

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1
