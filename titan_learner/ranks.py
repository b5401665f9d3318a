"""Which process this is, with or without a process group (a plain `python` run is rank 0 of 1)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_cuda_index(visible: int | None = None) -> int:
    """This rank's CUDA device: LOCAL_RANK's, or 0 where the launcher shows each process its
    one GPU (CUDA_VISIBLE_DEVICES per task, Slurm's --gpus-per-task): TorchTitan's rule
    (`torchtitan.tools.utils.get_local_device`). `visible`: the GPUs this process sees
    (default: CUDA's count)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count() if visible is None else visible
    if visible == 1:
        return 0
    if local >= visible:
        raise ValueError(
            f"LOCAL_RANK={local} and this process sees {visible} GPUs; allowed: a LOCAL_RANK "
            "below the GPUs each process sees, or one GPU per process (CUDA_VISIBLE_DEVICES)"
        )
    return local
