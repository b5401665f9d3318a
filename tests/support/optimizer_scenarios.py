"""What each rank of a test world runs to compare the learner's local-shard Adam with torch's.

Importable by spawned processes (they unpickle these functions by module name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.support.models import tiny_config
from titan_learner.learner.optim.local_shard_adam import local_shards
from titan_learner.learner.titan import TitanLearner

STEPS = 3


class DTensorOperators(TorchDispatchMode):
    """Counts the operators called with a DTensor argument (each one a trip through DTensor's
    sharding propagation)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves, _ = tree_flatten((args, kwargs or {}))
        self.count += any(isinstance(leaf, DTensor) for leaf in leaves)
        return func(*args, **(kwargs or {}))


def _set_grads(params: list[torch.Tensor], step: int, replicate_first: bool) -> None:
    """Seeded gradients laid out as their parameters (FSDP's); the first one replicated
    instead, with `replicate_first`, as a layout the local path must not take."""
    generator = torch.Generator().manual_seed(step)
    for i, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator) * 1e-2
        placements = param.placements
        if replicate_first and i == 0:
            placements = [Replicate()] * len(placements)
        param.grad = DTensor.from_local(grad, param.device_mesh, [Replicate()] * len(placements))
        param.grad = param.grad.redistribute(param.device_mesh, placements)


def _run(optimizer: torch.optim.Optimizer, params, replicate_first: bool) -> dict[str, Any]:
    """STEPS steps from the current weights; the operators that went through DTensor's
    dispatch after the first (which creates the moments), and the local results."""
    mode = DTensorOperators()
    for step in range(STEPS):
        _set_grads(params, step, replicate_first)
        if step == 0:
            optimizer.step()
        else:
            with mode:
                optimizer.step()
    states = [optimizer.state[p] for p in params]
    return {
        "dtensor_operators": mode.count,
        "weights": [p.to_local().detach().clone() for p in params],
        "exp_avg": [s["exp_avg"].to_local().clone() for s in states],
        "exp_avg_sq": [s["exp_avg_sq"].to_local().clone() for s in states],
    }


def compare_with_torch_adamw(
    rank: int, parallelism: dict, replicate_first: bool, implementation: str = "auto"
) -> dict:
    """The learner's AdamW and torch's own, each STEPS steps from the same weights and
    gradients on one layout of the world."""
    optimizer = {"lr": 1e-2, "weight_decay": 0.1, "implementation": implementation}
    config = tiny_config(parallelism=parallelism, optimizer=optimizer)
    learner = TitanLearner.from_config(config)
    (inner,) = learner.optimizer.optimizers
    (group,) = inner.param_groups
    params = list(group["params"])
    start = [p.detach().clone() for p in params]
    ours = _run(inner, params, replicate_first)
    with torch.no_grad():
        for param, value in zip(params, start, strict=True):
            param.copy_(value)
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "foreach", "fused")}
    theirs = _run(torch.optim.AdamW(params, **hyper), params, replicate_first)
    _set_grads(params, 0, replicate_first)
    grads = [p.grad for p in params]
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    return {
        "ours": ours,
        "theirs": theirs,
        "local_path": local_shards(params, grads, *moments, []) is not None,
        "placements": sorted({str(p.placements) for p in params}),
    }


def compare_layouts(rank: int) -> dict[str, dict]:
    torch.manual_seed(0)
    return {
        "dp_shard=2": compare_with_torch_adamw(rank, {"dp_shard": 2}, replicate_first=False),
        "tp=2": compare_with_torch_adamw(rank, {"tp": 2, "dp_shard": 1}, replicate_first=False),
        "dp_shard=2 fused": compare_with_torch_adamw(
            rank, {"dp_shard": 2}, replicate_first=False, implementation="fused"
        ),
        "dp_shard=2, a replicated gradient": compare_with_torch_adamw(
            rank, {"dp_shard": 2}, replicate_first=True
        ),
    }
