"""`[optimizer] implementation`: what each value builds, on this machine's CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_learner.config.toml import load_config
from titan_learner.learner.optim.optimizer import build_optimizer

EXPECTED = {  # the torch optimizer's (fused, foreach) flags
    "auto": (False, True),  # foreach on a CPU, fused on CUDA (docs/performance.md)
    "fused": (True, False),
    "foreach": (False, True),
    "for-loop": (False, False),
}


@pytest.mark.parametrize("implementation", list(EXPECTED))
def test_each_implementation_builds_the_torch_optimizer_it_names(implementation):
    config = load_config("configs/debug.toml", [f"optimizer.implementation={implementation}"])
    optimizer = build_optimizer(nn.Linear(4, 3), config, "cpu")
    (group,) = optimizer.optimizers[0].param_groups
    assert (bool(group["fused"]), bool(group["foreach"])) == EXPECTED[implementation]


def test_the_fused_cpu_step_equals_the_foreach_step():
    """`fused`, opt-in on a CPU, lands on the weights that `foreach` (`auto` there) does."""
    start = nn.Linear(16, 8).state_dict()
    weights = {}
    for implementation in ("foreach", "fused"):
        config = load_config("configs/debug.toml", [f"optimizer.implementation={implementation}"])
        model = nn.Linear(16, 8)
        model.load_state_dict(start)
        optimizer = build_optimizer(model, config, "cpu")
        for step in range(3):
            grads = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        weights[implementation] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(weights["foreach"], weights["fused"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
