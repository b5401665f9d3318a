"""Gradient-norm clipping on each rank's local gradient shards, with one all-reduce.

`torch.nn.utils.clip_grad_norm_` over FSDP's DTensor gradients sends each of its operations
(the per-tensor norms, their stack, the total, the scaling) through DTensor's dispatch, and the
total's redistribution runs one all-reduce per sharded mesh dimension. On a small model on a CPU
that was ~5% of an optimizer step. The same norm comes from the local shards: each rank's
squared norm of a shard, divided by the number of ranks that hold that same shard (its replicas
over the mesh dimensions where it is replicated), summed over the world once, counts every
element of every gradient once. The result equals the DTensor computation up to float rounding
(the sums are ordered differently; in a one-process world it is torch's own computation, bit
for bit), and the scaling is the same: every gradient multiplied by `max_norm / (norm + 1e-6)`,
clamped to 1.

Gradients this cannot read (a `Partial` placement, a mesh smaller than the world, plain tensors
in a world of several processes, mixed devices or dtypes) take torch's own function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _local_shards(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]] | None:
    """Each gradient's local tensor and how many ranks hold that same tensor, or None if some
    gradient's layout is not one this module reads."""
    world = _world_size()
    shards, replicas = [], []
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            if mesh.size() != world or any(p.is_partial() for p in grad.placements):
                return None
            # Every placement but Replicate splits it here (Shard, and FSDP x TP's _StridedShard)
            split = (mesh.size(d) for d, p in enumerate(grad.placements) if not p.is_replicate())
            pieces = math.prod(split)
            shards.append(grad.to_local())
            replicas.append(world // pieces)
        elif world == 1:
            shards.append(grad)
            replicas.append(1)
        else:
            return None
    first = shards[0]
    if any(s.device != first.device or s.dtype != first.dtype for s in shards):
        return None
    return shards, replicas


@functools.cache
def _replica_counts(replicas: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The counts as a device tensor, made once: a copy to a GPU at every step would wait for
    the kernels queued before it. None when every shard is held once (one process, or FSDP
    alone): x / 1 is x, so there is nothing to divide."""
    if all(count == 1 for count in replicas):
        return None
    return torch.tensor(replicas, dtype=torch.float64, device=device)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of `parameters` in place to a global 2-norm of at most `max_norm`;
    return that norm before clipping (a 0-d float tensor, the same on every rank), as
    `torch.nn.utils.clip_grad_norm_` does. A collective in a world of several processes: every
    rank calls it with the same parameters."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = _local_shards(grads)
    if local is None:
        return nn.utils.clip_grad_norm_(params, max_norm)
    shards, replicas = local
    norms = torch.stack(torch._foreach_norm(shards))
    if _world_size() == 1:  # torch's own total, so its clip to the bit: nothing to sum over ranks
        total = torch.linalg.vector_norm(norms)
    else:
        squared = norms.double().square()
        counts = _replica_counts(tuple(replicas), norms.device)
        if counts is not None:
            squared = squared / counts
        squared = squared.sum()
        dist.all_reduce(squared)
        total = squared.sqrt().to(shards[0].dtype)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(shards, coefficient)
    return total
