"""The job's few collectives: gathering metrics over data-parallel ranks, one batch per
tensor-parallel group, one outcome on every rank when a rank fails, and rank 0's decisions."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def gather_over(
    values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """All data-parallel ranks' values, concatenated (every rank gets all).

    The tensors travel on the learner's device: NCCL refuses CPU tensors.
    """
    if group is None:
        return values
    local = values.to(device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return torch.cat(out).cpu()


def gather_objects(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every data-parallel rank's `value` (picklable), in rank order."""
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def same_within_group(batch, group: dist.ProcessGroup | None):
    """Tensor-parallel peers must train on one batch: take the group's first rank's rollout.

    Peers sample alike from the same seed, but GPU kernels need not be bitwise deterministic,
    and two different batches in one TP group would silently corrupt the update.
    """
    if group is None:
        return batch
    holder = [batch.cpu()]  # an object broadcast: peers' rollouts may even differ in width
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0].to(batch.device)


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` (picklable) on every rank: one decision, taken where the files are."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def raise_everywhere(error: Exception | None) -> None:
    """If any rank failed (e.g. a reward raised), raise its error on every rank.

    A rank that raised alone would leave the others waiting in the next collective. The error
    itself travels (pickled), so every rank raises the same type with the same message.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _portable(error))
    if error is not None:
        raise error
    failed = next((report for report in reports if report is not None), None)
    if failed is not None:
        raise failed


def _portable(error: Exception | None) -> Exception | None:
    """The error if it pickles, else a RuntimeError with its message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
