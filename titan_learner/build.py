"""One place that turns a config into a TorchTitan-built, sharded, initialized model.

Used by the Learner (the policy) and by anything else sharded like it (a frozen reference model):
join the process group, build the mesh, build on meta, shard with the model's own TorchTitan
plan, materialize, then load the layout-independent initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_learner import model as titan_model
from titan_learner import parallel, platform

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config import Config


@dataclass
class ShardedModel:
    model: nn.Module
    spec: ModelSpec
    dims: ParallelDims
    device: torch.device


def build_sharded_model(config: Config, dims: ParallelDims | None = None) -> ShardedModel:
    """Build and shard the model of `config` on the default process group (formed if needed).

    Run under torchrun for several processes; a plain `python` run forms a world of one.
    `dims`: an existing mesh to shard on (a second model on the same layout then shares its
    process groups instead of creating new communicators).
    """
    titan_model.require_hf_checkpoint(config.model, config.source)
    device_type = platform.resolve_device_type(config.learner.device)
    parallel.init_process_group(device_type)
    if dims is None:
        dims = parallel.build_parallel_dims(config, dist.get_world_size())
    attention = platform.attention_backend(config.model.attention, device_type)
    spec = titan_model.model_spec(config.model, attention, config.source)
    parallel.prepare_model_config(spec, config)
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    full = titan_model.full_initial_state(spec, config.model, config.run.seed)
    model = parallel.parallelize(titan_model.build_meta(spec, config.source), spec, dims, config)
    titan_model.materialize(model, device)
    titan_model.load_full_state(model, full)
    return ShardedModel(model=model, spec=spec, dims=dims, device=device)
