"""A TorchRL Trainer whose optimization is the learner's (`titan_learner.LearnerStepper`):
TorchRL's own `Trainer.optim_steps` on the same batches gives the learner's own `train_step`,
loss, gradient norm and weights, with and without accumulation (dp_shard=2:
tests/integration/test_torchrl_trainer.py)."""

from __future__ import annotations

import pytest
import torch
from torchrl.trainers import Trainer

from tests.support.models import batches, tiny_config
from titan_learner import LearnerStepper
from titan_learner.learner.local import LocalLearner

F32 = torch.float32


def torchrl_trainer(learner) -> Trainer:
    """TorchRL's Trainer as a recipe builds it, its optimization handed to the learner (no
    collector: `optim_steps` is called with each batch, as `train()` does per collected one)."""
    return Trainer(
        collector=None,
        total_frames=0,
        frame_skip=1,
        optim_steps_per_batch=1,
        loss_module=learner.loss_module,
        optimization_stepper=LearnerStepper(learner),
        progress_bar=False,
    )


def trained_both_ways(sections: dict) -> tuple[list, list, LocalLearner, LocalLearner]:
    own, through = LocalLearner(tiny_config(**sections)), LocalLearner(tiny_config(**sections))
    trainer = torchrl_trainer(through)
    own_metrics, stepped = [], []
    for batch in batches(3, varied=True):
        own_metrics.append(own.train_step(batch.clone()))
        stepped.append(trainer.optimization_stepper.step(trainer, batch.clone()))
    return own_metrics, stepped, own, through


@pytest.mark.parametrize("sections", [{}, {"learner": {"grad_accum_steps": 2}}])
def test_torchrls_trainer_steps_the_learner_as_its_own_train_step_does(sections):
    own_metrics, stepped, own, through = trained_both_ways(sections)
    for want, got in zip(own_metrics, stepped, strict=True):
        assert set(got.keys()) == set(want.keys())
        for key in ("loss_objective", "grad_norm", "clip_fraction", "entropy"):
            assert float(got[key]) == float(want[key]), key
    for name, tensor in own.get_weights(dtype=F32).items():
        assert torch.equal(through.get_weights(dtype=F32)[name], tensor), name
    assert through.step == own.step == 3


def test_the_trainers_own_loop_calls_the_stepper_once_per_sub_batch():
    """`Trainer.optim_steps` (what `train()` runs on each collected batch): the learner steps
    once per optimization, to the weights of its own `train_step`."""
    own, through = LocalLearner(tiny_config()), LocalLearner(tiny_config())
    start = dict(own.get_weights(dtype=F32).items())
    trainer = torchrl_trainer(through)
    batch = batches(1, varied=True)[0]
    trainer.optim_steps(batch.clone())
    own.train_step(batch.clone())
    assert through.step == 1
    for name, tensor in own.get_weights(dtype=F32).items():
        assert torch.equal(through.get_weights(dtype=F32)[name], tensor), name
        assert not torch.equal(tensor, start[name]), name


def test_a_trainer_checkpoint_of_a_learner_is_refused_in_one_line():
    stepper = LearnerStepper(LocalLearner(tiny_config()))
    with pytest.raises(NotImplementedError, match=r"learner.save\(directory\) \(DCP"):
        stepper.state_dict()
