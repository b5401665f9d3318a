"""A TorchRL `Trainer` (or `GRPOTrainer`) whose optimization is a Learner's: the adapter TorchRL
users take as `optimization_stepper=`.

Built on `torchrl.trainers.OptimizationStepper`, the contract TorchRL's Trainer and GRPOTrainer
call once per sub-batch (`step(trainer, sub_batch)`, a TensorDict of detached scalars back).
Each call is one `Learner.train_step`: the learner's own split into `[learner]
grad_accum_steps` micro-batches (or token-budget ones) with the step's exact token means, the
gradient reduction deferred to the last one, global clipping across FSDP x TP, the optimizer
and scheduler steps, a non-finite loss dropped on every rank; with a `reference`, the KL
reference's log-probs scored first. What the trainer's own `loss_module` and `optimizer` would
do is the learner's, so the Trainer creates no optimizer hook of its own (TorchRL's rule when a
stepper is given).

Checkpoints stay the learner's (`Learner.save` / `load`: DCP, each rank its shards, resumable on
any layout): TorchRL's trainer checkpoint torch.saves one process's state dict, which cannot
hold a sharded learner, so this stepper's `state_dict` says so instead of saving part of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensordict import TensorDict, TensorDictBase
from torchrl.trainers.trainers import OptimizationStepper

if TYPE_CHECKING:
    from torchrl.trainers import Trainer

    from titan_learner.learner.contract import Learner
    from titan_learner.learner.reference_scoring import Reference


class LearnerStepper(OptimizationStepper):
    """`optimization_stepper=` for a TorchRL Trainer: each sub-batch is one `learner.train_step`
    (a collective: every rank's trainer calls it with its own sub-batch, the same number of
    times). The sub-batch is in the learner's batch format (titan_learner.check_batch)."""

    def __init__(self, learner: Learner, reference: Reference | None = None) -> None:
        self.learner = learner
        self.reference = reference

    def step(self, trainer: Trainer, sub_batch: TensorDictBase) -> TensorDictBase:
        metrics = self.learner.train_step(sub_batch, self.reference)
        return TensorDict({key: value.detach() for key, value in metrics.items()}, [])

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "a Learner is saved with learner.save(directory) (DCP: each rank's shards, loadable "
            "on any layout); TorchRL's trainer checkpoint would torch.save one process's part"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("a Learner is restored with learner.load(directory)")
