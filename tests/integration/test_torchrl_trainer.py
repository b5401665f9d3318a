"""TorchRL's Trainer stepping a TitanLearner at dp_shard=2 (`titan_learner.LearnerStepper`):
each rank's trainer hands its half of every batch to the stepper, and the result is the
one-process learner's own `train_step` on the whole batches."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import batches, tiny_config
from tests.support.worlds import run_world
from tests.unit.test_torchrl_trainer import torchrl_trainer
from titan_learner.learner.local import LocalLearner

TOL = 1e-5
SECTIONS = {"parallelism": {"dp_shard": 2}, "learner": {"grad_accum_steps": 2}}


def trainer_on_two_ranks(rank: int) -> dict:
    from titan_learner.learner.titan import TitanLearner

    learner = TitanLearner.from_config(tiny_config(**SECTIONS))
    trainer = torchrl_trainer(learner)
    metrics = []
    for batch in batches(3, varied=True):
        stepped = trainer.optimization_stepper.step(trainer, learner.local_batch(batch))
        metrics.append({key: float(value) for key, value in stepped.items()})
    return {"metrics": metrics, "weights": dict(learner.get_weights(dtype=torch.float32).items())}


@pytest.mark.slow
def test_torchrls_trainer_on_two_ranks_equals_one_process_train_steps():
    rank0, rank1 = run_world(2, trainer_on_two_ranks)
    reference = LocalLearner(tiny_config(learner={"grad_accum_steps": 2}))
    for got, batch in zip(rank0["metrics"], batches(3, varied=True), strict=True):
        want = reference.train_step(batch)
        for key in ("loss_objective", "grad_norm", "clip_fraction", "entropy"):
            assert got[key] == pytest.approx(float(want[key]), abs=TOL), key
    assert rank0["metrics"] == rank1["metrics"]
    for name, tensor in reference.get_weights(dtype=torch.float32).items():
        torch.testing.assert_close(rank0["weights"][name], tensor, atol=TOL, rtol=0, msg=name)
