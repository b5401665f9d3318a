"""The model from TorchTitan's registry: its spec (flavor + shape overrides + attention), built
on the meta device. Weights come later (`initial_state`), sharding from `parallelize`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.model.hf_architecture import (
    HFArchitecture,
    agree,
    apply_details,
    read_architecture,
)

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config.schema import ModelSection


def _registry(name: str):
    if name == "llama3":
        from torchtitan.models.llama3 import llama3_configs as configs
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.qwen3 import model_registry
        from torchtitan.models.qwen3 import qwen3_configs as configs
    return model_registry, configs


def _resized_layers(name: str, base, o, attn_backend: str) -> list:
    """Rebuild the per-layer configs with TorchTitan's own layer builder at the new shape."""
    attn = base.layers[0].attention
    qkv = attn.qkv_linear
    dim = o.dim or base.dim
    n_heads = o.n_heads or attn.n_heads
    n_kv_heads = o.n_kv_heads or (qkv.n_kv_heads if o.n_heads is None else n_heads)
    head_dim = o.head_dim or (qkv.head_dim if name == "qwen3" and o.dim is None else dim // n_heads)
    hidden_dim = o.hidden_dim or base.layers[0].feed_forward.w1.out_features
    rope = dataclasses.replace(
        attn.rope,
        dim=head_dim,
        max_seq_len=o.max_seq_len or attn.rope.max_seq_len,
        theta=o.rope_theta or attn.rope.theta,
    )
    common = dict(
        n_layers=o.n_layers or len(base.layers),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=hidden_dim,
        rope=rope,
        attn_backend=attn_backend,
    )
    if name == "llama3":
        from torchtitan.models.llama3 import _build_llama3_layers

        return _build_llama3_layers(**common)
    from torchtitan.models.qwen3 import _build_qwen3_layers

    return _build_qwen3_layers(head_dim=head_dim, **common)


def model_spec(
    section: ModelSection,
    attention: str,
    source: str = "<config>",
    arch: HFArchitecture | None = None,
) -> ModelSpec:
    """TorchTitan's ModelSpec for [model], with overrides applied and the attention backend set.

    arch: the architecture to build, when it is not `hf_checkpoint`'s config.json (export reads
    the one recorded beside the checkpoints)."""
    registry, configs = _registry(section.name)
    if section.flavor not in configs:
        raise ConfigError(
            f"unknown {section.name} flavor '{section.flavor}'{did_you_mean(section.flavor, configs)}; "
            f"allowed: {', '.join(configs)}",
            source=source,
            where="[model] flavor",
        )
    spec = registry(section.flavor, attn_backend="flex")
    cfg = spec.model
    o = section.overrides
    if arch is None and section.hf_checkpoint:
        arch = read_architecture(section.hf_checkpoint, source)
    if arch is not None:  # the model directory decides the shape
        o = agree(section, arch, source)
    if any(getattr(o, f.name) is not None for f in dataclasses.fields(o) if f.name != "vocab_size"):
        cfg.layers = _resized_layers(section.name, cfg, o, "flex")
        cfg.dim = o.dim or cfg.dim
        cfg.norm = dataclasses.replace(cfg.norm, normalized_shape=cfg.dim)
        cfg.tok_embeddings = dataclasses.replace(cfg.tok_embeddings, embedding_dim=cfg.dim)
        cfg.lm_head = dataclasses.replace(cfg.lm_head, in_features=cfg.dim)
    if o.vocab_size is not None:
        cfg.vocab_size = o.vocab_size
        cfg.tok_embeddings = dataclasses.replace(cfg.tok_embeddings, num_embeddings=o.vocab_size)
        cfg.lm_head = dataclasses.replace(cfg.lm_head, out_features=o.vocab_size)
    if arch is not None:
        apply_details(cfg, arch)
    if attention == "sdpa":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if section.lora is not None:
        from titan_learner.model.lora import apply_lora

        apply_lora(spec, section.lora, source)
    return spec


def uses_flex_attention(model: nn.Module) -> bool:
    from torchtitan.models.common.attention import FlexAttention

    first = model.config.first_attention
    return first is not None and isinstance(first.inner_attention, FlexAttention.Config)


def build_meta(spec: ModelSpec, source: str = "<config>") -> nn.Module:
    """Build on the meta device; a shape TorchTitan rejects is a [model.overrides] error."""
    try:
        with torch.device("meta"):
            return spec.model.build()
    except ValueError as err:
        raise ConfigError(str(err), source=source, where="[model.overrides]") from None
