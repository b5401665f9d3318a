"""The learner's Adam/AdamW step on local shards (titan_learner.learner.optim.local_shard_adam) equals
torch's own step on the DTensors bit for bit, and skips DTensor's dispatch, in a real gloo world."""

from __future__ import annotations

import pytest
import torch

from tests.support.optimizer_scenarios import compare_layouts
from tests.support.worlds import run_world


@pytest.fixture(scope="module")
def world2():
    return run_world(2, compare_layouts)


def assert_bit_equal(ours: dict, theirs: dict) -> None:
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        for i, (a, b) in enumerate(zip(ours[key], theirs[key], strict=True)):
            assert torch.equal(a, b), (key, i, float((a - b).abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp_shard=2", "tp=2", "dp_shard=2 fused"])
def test_the_local_step_equals_torch_adamw_on_dtensors(world2, layout):
    for rank in world2:
        result = rank[layout]
        assert result["local_path"]
        assert_bit_equal(result["ours"], result["theirs"])
        assert result["ours"]["dtensor_operators"] == 0  # nothing went through DTensor
        assert result["theirs"]["dtensor_operators"] > 0
    if layout == "tp=2":  # the layout really mixes placements
        assert len(world2[0][layout]["placements"]) > 1, world2[0][layout]["placements"]


@pytest.mark.slow
def test_a_gradient_laid_out_unlike_its_parameter_takes_torch_step(world2):
    for rank in world2:
        result = rank["dp_shard=2, a replicated gradient"]
        assert not result["local_path"]
        assert_bit_equal(result["ours"], result["theirs"])
        assert result["ours"]["dtensor_operators"] > 0
