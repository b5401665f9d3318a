"""The transformers config that matches a TorchTitan model config, for exported weights.

Exported tensors only mean something to a receiver (transformers, vLLM) whose architecture
matches exactly: dims, heads, FFN width, norm eps, RoPE base and scaling, tied embeddings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec
    from transformers import PretrainedConfig

    from titan_learner.config.schema import Config


def rope_parameters(rope) -> dict:
    """TorchTitan's RoPE config as transformers' `rope_parameters`."""
    params: dict = {"rope_theta": float(rope.theta)}
    if rope.scaling == "llama":
        params.update(
            rope_type="llama3",
            factor=float(rope.scaling_factor),
            low_freq_factor=float(rope.low_freq_factor),
            high_freq_factor=float(rope.high_freq_factor),
            original_max_position_embeddings=int(rope.original_max_position_embeddings),
        )
    elif rope.scaling == "none":
        params["rope_type"] = "default"
    else:
        raise NotImplementedError(f"RoPE scaling {rope.scaling!r} has no transformers mapping yet")
    return params


def _max_positions(rope) -> int:
    """transformers wants llama3-scaled RoPE's original context below the maximum one."""
    if rope.scaling == "llama":
        scaled = int(rope.original_max_position_embeddings * rope.scaling_factor)
        return max(rope.max_seq_len, scaled)
    return rope.max_seq_len


def hf_config(spec: ModelSpec) -> PretrainedConfig:
    """A LlamaConfig / Qwen3Config describing exactly the model `spec` builds."""
    from transformers import LlamaConfig, Qwen3Config

    cfg = spec.model
    attention = cfg.layers[0].attention
    qkv = attention.qkv_linear
    rope = attention.rope
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.layers[0].feed_forward.w1.out_features,
        num_hidden_layers=len(cfg.layers),
        num_attention_heads=attention.n_heads,
        num_key_value_heads=qkv.n_kv_heads,
        head_dim=qkv.head_dim,
        rms_norm_eps=cfg.norm.eps,
        tie_word_embeddings=cfg.enable_weight_tying,
        max_position_embeddings=_max_positions(rope),
        rope_parameters=rope_parameters(rope),
        architectures=[{"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[spec.name]],
    )
    if spec.name == "llama3":
        return LlamaConfig(**common)
    return Qwen3Config(**common)


def hf_parameter_shapes(config: Any) -> tuple[dict[str, torch.Size], list[str]]:
    """Shapes of every HF parameter name (tied aliases included) and the names that must be sent,
    from a meta-device build of the transformers model: no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {
        name: t.shape
        for name, t in model.state_dict(keep_vars=True).items()
        if isinstance(t, nn.Parameter)
    }
    return shapes, [name for name, _ in model.named_parameters()]


def learner_hf_config(config: Config) -> Any:
    """The transformers config of the learner's model (the engines serve the same shapes),
    from the config alone: no weights, no engine directory."""
    from titan_learner.model.parallelize import prepare_model_config
    from titan_learner.model.spec import model_spec

    spec = model_spec(config.model, "sdpa", config.source)
    prepare_model_config(spec, config)
    return hf_config(spec)
