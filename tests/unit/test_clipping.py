"""The learner's clip (titan_learner.learner.optim.clipping) equals torch's on one process; across
processes and layouts the parity tests compare its norm with the one-process learner's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from titan_learner.learner.optim.clipping import clip_grad_norm_


def with_grads(
    seed: int, dtypes=(torch.float32, torch.float32, torch.float32)
) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for i, dtype in enumerate(dtypes):
        param = nn.Parameter(torch.zeros(3 + i, 5, dtype=dtype))
        param.grad = torch.randn(3 + i, 5, generator=generator).to(dtype)
        params.append(param)
    params.append(nn.Parameter(torch.zeros(2)))  # no gradient: left out, as torch does
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e3, math.inf], ids=["clipped", "not clipped", "inf"])
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32,) * 3, (torch.float32, torch.float64, torch.float32)],
    ids=["one dtype", "mixed dtypes: torch's own"],
)
def test_equals_torch_clip_grad_norm(max_norm, dtypes):
    mine, theirs = with_grads(0, dtypes), with_grads(0, dtypes)
    norm = clip_grad_norm_(mine, max_norm)
    want = nn.utils.clip_grad_norm_(theirs, max_norm)
    assert float(norm) == float(want)  # one process: torch's own computation, bit for bit
    for got, expected in zip(mine, theirs, strict=True):
        if expected.grad is None:
            assert got.grad is None
        else:
            assert torch.equal(got.grad, expected.grad)
    if max_norm < float(want):
        total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in mine[:3]))
        assert total == pytest.approx(max_norm, rel=1e-5)


def test_a_non_finite_gradient_gives_a_non_finite_norm():
    params = with_grads(1)
    params[1].grad[0, 0] = math.inf
    assert not math.isfinite(float(clip_grad_norm_(params, 1.0)))


def test_no_gradient_at_all_is_a_zero_norm():
    assert float(clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0)) == 0.0
