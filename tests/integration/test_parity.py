"""Sharded learners equal the one-process LocalLearner: losses, grad norms, gathered weights.

One spawned gloo world per size runs every layout of that size, so each world is paid once.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import batches, tiny_config
from tests.support.scenarios import STEPS, loss_parameter_rejected, run_layouts
from tests.support.worlds import run_world
from titan_learner.learner.local import LocalLearner

TOL = 1e-5
COMPARED = ("loss_objective", "loss_entropy", "grad_norm")

WORLD2 = {
    "dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}},
    "tp=2": {"sections": {"parallelism": {"tp": 2, "dp_shard": 1}}},
    "dp_replicate=2": {"sections": {"parallelism": {"dp_replicate": 2, "dp_shard": 1}}},
    "dp_shard=2 full AC": {
        "sections": {"parallelism": {"dp_shard": 2}, "activation_checkpoint": {"mode": "full"}}
    },
    "dp_shard=2 selective AC": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "activation_checkpoint": {"mode": "selective"},
        }
    },
    "qwen3 dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}, "model": "qwen3"},
    "qwen3 tp=2": {"sections": {"parallelism": {"tp": 2, "dp_shard": 1}}, "model": "qwen3"},
    "dp_shard=2 accumulate 2": {
        "sections": {"parallelism": {"dp_shard": 2}, "learner": {"grad_accum_steps": 2}},
        "accumulate": True,
    },
}
WORLD4 = {
    "dp_shard=2 x tp=2": {"sections": {"parallelism": {"dp_shard": 2, "tp": 2}}},
    "qwen3 dp_shard=2 x tp=2": {
        "sections": {"parallelism": {"dp_shard": 2, "tp": 2}},
        "model": "qwen3",
    },
}


def local_run(model: str) -> dict:
    learner = LocalLearner(tiny_config(model))
    metrics = [dict(learner.update(batch).items()) for batch in batches(STEPS)]
    return {
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
        "weights": dict(learner.get_weights(dtype=torch.float32).items()),
    }


@pytest.fixture(scope="module")
def reference():
    return local_run("llama3")


@pytest.fixture(scope="module")
def qwen3_reference():
    return local_run("qwen3")


def reference_for(layout: str, reference, qwen3_reference):
    return qwen3_reference if layout.startswith("qwen3") else reference


@pytest.fixture(scope="module")
def world2():
    return run_world(2, run_layouts, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_world(4, run_layouts, WORLD4)


def assert_matches(result, reference, compared=COMPARED):
    for step, (got, want) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in compared:
            assert got[key] == pytest.approx(want[key], abs=TOL), (step, key)
    assert set(result["weights"]) == set(reference["weights"])
    for name, want in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], want, atol=TOL, rtol=0, msg=name)


def test_one_process_titan_learner_matches_local(reference):
    layouts = {
        "llama3": {"sections": {}},
        "qwen3": {"sections": {}, "model": "qwen3"},
        "compiled": {"sections": {"compile": {"enable": True}}},
    }
    [result] = run_world(1, run_layouts, layouts)
    assert_matches(result["llama3"], reference)
    assert_matches(result["compiled"], reference)  # per-block torch.compile, HF names exported
    assert_matches(result["qwen3"], local_run("qwen3"))
    assert result["llama3"]["capabilities"].sharded


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(WORLD2))
def test_two_process_layouts_match_local(world2, reference, qwen3_reference, layout):
    reference = reference_for(layout, reference, qwen3_reference)
    rank0, rank1 = world2
    # With accumulation the stepping call reports its own micro-batch's loss, not the window's;
    # the grad norm and the weights show the window equals one full batch.
    compared = ("grad_norm",) if WORLD2[layout].get("accumulate") else COMPARED
    assert_matches(rank0[layout], reference, compared)
    assert rank1[layout]["weights"] == {}, "get_weights() must be empty off rank 0"
    # every rank reports the same data-parallel-averaged metrics
    assert rank0[layout]["metrics"] == rank1[layout]["metrics"]


@pytest.mark.slow
def test_fsdp_x_tp_on_four_processes_matches_local(world4, reference, qwen3_reference):
    assert_matches(world4[0]["dp_shard=2 x tp=2"], reference)
    assert_matches(world4[0]["qwen3 dp_shard=2 x tp=2"], qwen3_reference)
    capabilities = world4[0]["dp_shard=2 x tp=2"]["capabilities"]
    assert (capabilities.data_parallel_size, capabilities.tensor_parallel_size) == (2, 2)


@pytest.mark.slow
def test_trainable_loss_parameters_are_rejected_under_data_parallelism():
    messages = run_world(2, loss_parameter_rejected)
    for message in messages:
        assert message.startswith("the loss module has trainable parameters of its own (scale)")
        assert "with 2 data-parallel ranks their gradients would not be synchronized" in message
