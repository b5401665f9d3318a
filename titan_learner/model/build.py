"""The one path from a config to a built, initialized model: plain (LocalLearner) or sharded.

Build on the meta device, shard with the model's own TorchTitan plan (when sharded),
materialize, then load the layout-independent initial weights: the same steps, in the same
order, for the one-process reference and for every sharded layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_learner.config.validate import attention_backend, device_type, require_hf_checkpoint
from titan_learner.model.initial_state import full_initial_state, load_full_state, materialize
from titan_learner.model.lora import base_fingerprint
from titan_learner.model.parallelize import (
    build_parallel_dims,
    init_process_group,
    parallelize,
    prepare_model_config,
)
from titan_learner.model.spec import build_meta, model_spec

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config.schema import Config


@dataclass
class BuiltModel:
    model: nn.Module
    spec: ModelSpec
    dims: ParallelDims | None  # None: a plain, unsharded model
    device: torch.device
    base_fingerprint: str | None = None
    """[model.lora] with initial weights: the frozen base's checksum (model.lora)."""


def build_model(
    config: Config,
    *,
    sharded: bool = True,
    dims: ParallelDims | None = None,
    device: str | None = None,
    initial_weights: bool = True,
) -> BuiltModel:
    """Build the model of `config`; sharded on the default process group (formed if needed).

    sharded=True: run under torchrun for several processes; a plain `python` run forms a world
    of one. `dims`: an existing mesh to shard on (a second model on the same layout then shares
    its process groups instead of creating new communicators).
    sharded=False: one process, a plain model, no process group (the parity reference).
    device: overrides `[learner] device`.
    initial_weights=False: the model's own init only, for a model whose weights are copied in
    later (the job's kept weights versions): no HF checkpoint read, no full state in memory.
    """
    require_hf_checkpoint(config)
    kind = device_type(config, device)
    if sharded:
        init_process_group(kind)
        if dims is None:
            dims = build_parallel_dims(config, dist.get_world_size())
    spec = model_spec(config.model, attention_backend(config, kind), config.source)
    if sharded:
        prepare_model_config(spec, config)
    full = (
        full_initial_state(spec, config.model, config.run.seed, config.source)
        if initial_weights
        else None
    )
    model = build_meta(spec, config.source)
    if sharded:
        model = parallelize(model, spec, dims, config)
    place = (
        torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    )
    materialize(model, place)
    fingerprint = None
    if full is not None:
        load_full_state(model, full)
        if config.model.lora is not None:
            fingerprint = base_fingerprint(full)
    return BuiltModel(
        model=model,
        spec=spec,
        dims=dims if sharded else None,
        device=place,
        base_fingerprint=fingerprint,
    )
