"""Process group, device mesh and sharding: TorchTitan's ParallelDims and parallelize_fn.

The [parallelism], [activation_checkpoint] and [compile] sections map onto TorchTitan's own config
dataclasses here; the sharding plan itself (FSDP2, HSDP, TP/SP, AC, per-block compile) is the
model's own `parallelize_fn`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_learner.model import platform
from titan_learner.ranks import local_cuda_index

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config.schema import Config

# "spmd_types" (TorchTitan's default) fails for any mesh > 1 with torch 2.13; partial_dtensor works.
SPMD_BACKEND = "partial_dtensor"


def parallelism_config(config: Config):
    from torchtitan.config import ParallelismConfig

    p = config.parallelism
    return ParallelismConfig(
        data_parallel_replicate_degree=p.dp_replicate,
        data_parallel_shard_degree=p.dp_shard,
        tensor_parallel_degree=p.tp,
        enable_sequence_parallel=p.sequence_parallel,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        spmd_backend=SPMD_BACKEND,
    )


def training_config(config: Config):
    from torchtitan.config import TrainingConfig

    return TrainingConfig(
        mixed_precision_param=config.parallelism.param_dtype,
        mixed_precision_reduce=config.parallelism.reduce_dtype,
        max_norm=config.learner.clip_norm or 0.0,
        steps=config.run.steps,
        seq_len=config.run.seq_len,
    )


def compile_config(config: Config):
    from torchtitan.config import CompileConfig

    return CompileConfig(
        enable=config.compile.enable, backend=config.compile.backend, components=["model"]
    )


def ac_config(config: Config):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[
        config.activation_checkpoint.mode
    ]


def init_process_group(device_type: str) -> int:
    """Join (or form) the default process group: NCCL on CUDA, gloo on CPU. Returns the rank.
    A worker group torchrun restarted forms it apart from the dead one's, and a world of one
    without a launcher on its own store (model.elastic_store)."""
    from datetime import timedelta

    from torchtitan.config import CommConfig
    from torchtitan.distributed.utils import init_distributed

    from titan_learner.model.elastic_store import (
        init_group_on_store,
        restarted_group_store,
        single_process_store,
    )

    platform.set_titan_device_type(device_type)
    if not dist.is_initialized():
        alone = platform.default_single_process_env()
        if device_type == "cuda":
            torch.cuda.set_device(local_cuda_index())
        comm = CommConfig(trace_buf_size=0)
        timeout = timedelta(seconds=comm.init_timeout_seconds)
        store = single_process_store(timeout) if alone else restarted_group_store(timeout)
        if store is None:
            init_distributed(comm)
        else:
            init_group_on_store(device_type, store, timeout)
    return dist.get_rank()


def build_parallel_dims(config: Config, world_size: int) -> ParallelDims:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    from titan_learner.config.validate import check_world_size

    dp_replicate, dp_shard, tp = check_world_size(config, world_size)
    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=1,
        tp=tp,
        pp=1,
        ep=1,
        world_size=world_size,
        spmd_backend=SPMD_BACKEND,
    )
    set_spmd_backend(SPMD_BACKEND)  # process-global in TorchTitan; its losses assert on it
    dims.build_mesh()
    return dims


def prepare_model_config(spec: ModelSpec, config: Config) -> None:
    """Fill the per-module TP plan (and check heads divisible by tp) before the meta build."""
    from titan_learner.config.errors import ConfigError

    try:
        spec.model.update_from_config(
            config=SimpleNamespace(parallelism=parallelism_config(config))
        )
    except ValueError:
        attention = spec.model.layers[0].attention
        n_heads = attention.n_heads
        n_kv = attention.n_kv_heads or n_heads
        tp = config.parallelism.tp
        allowed = [d for d in range(1, n_kv + 1) if n_heads % d == 0 and n_kv % d == 0]
        raise ConfigError(
            f"tp = {tp} must divide n_heads ({n_heads}) and n_kv_heads ({n_kv}); "
            f"allowed: {', '.join(map(str, allowed))}",
            source=config.source,
            where="[parallelism] tp",
        ) from None


def parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, config: Config) -> nn.Module:
    """Apply the model's own TorchTitan plan: TP/SP, activation checkpointing, compile, FSDP2."""
    model = spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=training_config(config),
        parallelism=parallelism_config(config),
        compile_config=compile_config(config),
        ac_config=ac_config(config),
        dump_folder=config.run.output_dir,
    )
    platform.force_sum_reduction_on_gloo(model)
    average_gradients_over_data_parallel(model)
    return model


def average_gradients_over_data_parallel(model: nn.Module) -> None:
    """Give FSDP back its default: gradients averaged over data-parallel ranks.

    TorchTitan turns FSDP's division off (factor 1.0) because its trainer divides the loss by the
    global token count; a TorchRL loss is a per-rank mean, so the reduction must be a mean too.
    The default (None) rather than an explicit factor: torch 2.13 divides twice by an explicit
    factor when the shard group has one rank (dp_replicate > 1, dp_shard = 1).
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(None)


def tensor_parallel_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group whose ranks must see the same data; None without tensor parallelism."""
    return dims.get_mesh("tp").get_group() if dims.tp_enabled else None


def data_parallel_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group whose ranks see different data (dp_replicate x dp_shard); None when it is 1."""
    if not dims.dp_enabled:
        return None
    return dims.get_mesh("batch").get_group()
