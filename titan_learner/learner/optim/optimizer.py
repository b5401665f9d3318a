"""[optimizer] and [lr_scheduler] as TorchTitan's OptimizersContainer and LRSchedulersContainer.

The container's Adam and AdamW are `titan_learner.learner.optim.local_shard_adam`'s: the same update,
bit for bit, on each rank's local shards instead of through DTensor's dispatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

    from titan_learner.config.schema import Config


def build_optimizer(model: nn.Module, config: Config, device_type: str) -> OptimizersContainer:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from titan_learner.learner.optim.local_shard_adam import LocalShardOptimizersContainer

    o = config.optimizer
    implementation = o.implementation
    if implementation == "auto":
        implementation = "fused" if device_type == "cuda" else "foreach"
    container_config = OptimizersContainer.Config(
        implementation=implementation,
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name=o.name,
                optimizer_kwargs={
                    "lr": o.lr,
                    "betas": tuple(o.betas),
                    "eps": o.eps,
                    "weight_decay": o.weight_decay,
                },
            )
        ],
    )
    return LocalShardOptimizersContainer(container_config, model_parts=[model])


def build_lr_scheduler(optimizer: OptimizersContainer, config: Config) -> LRSchedulersContainer:
    from torchtitan.components.optimizer import LRSchedulersContainer

    s = config.lr_scheduler
    scheduler_config = LRSchedulersContainer.Config(
        warmup_steps=s.warmup_steps,
        decay_ratio=0.0 if s.decay == "none" else None,
        decay_type="linear" if s.decay == "none" else s.decay,
        min_lr_factor=s.min_lr_factor,
    )
    return scheduler_config.build(optimizers=optimizer, training_steps=config.run.steps)
