"""LocalLearner: the Learner contract on one process with a plain, unsharded model."""

from __future__ import annotations

from torch import nn
from torchrl.trainers.trainers import OptimizationStepper

from titan_learner.config.schema import Config
from titan_learner.learner.contract import Capabilities, Learner
from titan_learner.model.build import build_model


class LocalLearner(Learner):
    """One process, a plain unsharded model from the same config: the parity reference."""

    def __init__(
        self,
        config: Config,
        *,
        loss_module: nn.Module | None = None,
        stepper: OptimizationStepper | None = None,
        device: str | None = None,
    ) -> None:
        built = build_model(config, sharded=False, device=device)
        super().__init__(
            config=config,
            model=built.model,
            spec=built.spec,
            loss_module=loss_module,
            stepper=stepper,
            device=built.device,
            data_parallel_group=None,
            capabilities=Capabilities(
                world_size=1,
                data_parallel_size=1,
                tensor_parallel_size=1,
                device_type=built.device.type,
                param_dtype="float32",
                gradient_accumulation=True,
                sharded=False,
            ),
        )
        self.base_fingerprint = built.base_fingerprint
