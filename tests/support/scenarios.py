"""What each rank of a test world runs: build a TitanLearner per layout, update, gather.

Importable by spawned processes (they unpickle these functions by module name).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.models import batches, tiny_config
from titan_learner.learner.titan import TitanLearner

STEPS = 3


def train_layout(
    sections: dict, steps: int = STEPS, accumulate: bool = False, model: str = "llama3"
) -> dict[str, Any]:
    """STEPS updates on the shared synthetic batches; metrics on every rank, weights on rank 0.

    accumulate=True feeds each global batch as two half-batches with grad_accum_steps=2.
    """
    config = tiny_config(model, **sections)
    learner = TitanLearner.from_config(config)
    metrics = []
    for batch in batches(steps):
        local = learner.local_batch(batch)
        if accumulate:
            half = local.batch_size[0] // 2
            learner.update(local[:half])
            metrics.append(dict(learner.update(local[half:]).items()))
        else:
            metrics.append(dict(learner.update(local).items()))
    weights = learner.get_weights(dtype=torch.float32)
    # Exported tensors are copies: changing them leaves the learner alone (a collective re-export).
    originals = {k: v.clone() for k, v in weights.items()}
    for tensor in weights.values():
        tensor.add_(1.0)
    again = learner.get_weights(dtype=torch.float32)
    assert all(torch.equal(again[k], v) for k, v in originals.items()), "export aliases weights"
    weights = originals
    return {
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
        "weights": {k: v.clone() for k, v in weights.items()},
        "capabilities": learner.capabilities,
    }


def run_layouts(rank: int, layouts: dict[str, dict]) -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: train_layout(**spec) for name, spec in layouts.items()}


def loss_parameter_rejected(rank: int) -> str:
    """A loss with its own trainable parameter on dp_shard=2: construction must refuse it."""
    from torch import nn

    class LearnedCoefficient(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    config = tiny_config(parallelism={"dp_shard": 2})
    try:
        TitanLearner.from_config(config, loss_module=LearnedCoefficient())
    except ValueError as err:
        return str(err)
    return "accepted"
