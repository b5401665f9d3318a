"""TitanLearner: the Learner contract on a TorchTitan-built, TorchTitan-sharded model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrl.trainers.trainers import OptimizationStepper

from titan_learner.config.schema import Config
from titan_learner.learner.contract import Capabilities, Learner
from titan_learner.model.build import build_model
from titan_learner.model.parallelize import data_parallel_group, tensor_parallel_group


class TitanLearner(Learner):
    """A TorchTitan-built, TorchTitan-sharded learner on the default process group."""

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        loss_module: nn.Module | None = None,
        stepper: OptimizationStepper | None = None,
    ) -> TitanLearner:
        """Join or form the process group, build the mesh, build and shard the model.

        Run under torchrun for several processes; a plain `python` run forms a world of one.
        """
        built = build_model(config)
        model, spec, dims, device = built.model, built.spec, built.dims, built.device
        world_size = dist.get_world_size()
        torch.manual_seed(config.run.seed + dist.get_rank())
        learner = cls(
            config=config,
            model=model,
            spec=spec,
            loss_module=loss_module,
            stepper=stepper,
            device=device,
            data_parallel_group=data_parallel_group(dims),
            tensor_parallel_group=tensor_parallel_group(dims),
            capabilities=Capabilities(
                world_size=world_size,
                data_parallel_size=dims.dp_replicate * dims.dp_shard,
                tensor_parallel_size=dims.tp,
                device_type=device.type,
                param_dtype=config.parallelism.param_dtype,
                gradient_accumulation=True,
                sharded=True,
            ),
        )
        learner.parallel_dims = dims  # the mesh, for models sharded alike (a reference)
        learner.base_fingerprint = built.base_fingerprint
        return learner
