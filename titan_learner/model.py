"""The model from TorchTitan's registry: spec, shape overrides, build, initial weights.

Initial weights are defined once, independent of the layout: a seeded full initialization (or a
Hugging Face checkpoint converted by TorchTitan's state-dict adapter) that every layout slices
its shards from. That is what makes a dp_shard=2 x tp=2 run start from exactly the weights of a
one-process run, and what parity tests and layout changes rely on.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_learner.schema import ConfigError, did_you_mean

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config import ModelSection


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


def model_spec(section: ModelSection, attention: str, source: str = "<config>") -> ModelSpec:
    """TorchTitan's ModelSpec for [model], with overrides applied and the attention backend set."""
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
    if attention == "sdpa":
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
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


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-built (possibly sharded) model and run its own init (buffers included).

    The random values this draws on sharded parameters are overwritten by `load_full_state`, so
    DTensor's warning that its CPU random ops may differ from a full tensor's does not apply.
    """
    model.to_empty(device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not")
        model.init_weights(buffer_device=device)


def full_initial_state(
    spec: ModelSpec, section: ModelSection, seed: int
) -> dict[str, torch.Tensor]:
    """The layout-independent starting weights: an HF checkpoint, or a seeded full init on CPU."""
    if section.hf_checkpoint:
        return load_hf_checkpoint(spec, section.hf_checkpoint)
    if section.init == "transformers":
        return transformers_initial_state(spec, seed)
    model = build_meta(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        materialize(model, torch.device("cpu"))
    return {k: v for k, v in model.state_dict().items()}


def transformers_initial_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The matching transformers model's own seeded init, converted by TorchTitan's adapter."""
    from transformers import AutoModelForCausalLM

    from titan_learner.hf_config import hf_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
    return _with_tied_alias(
        spec, spec.state_dict_adapter(spec.model, None).from_hf(hf_model.state_dict())
    )


def _with_tied_alias(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TorchTitan's state dict names a tied embedding twice; HF adapters return it once."""
    if spec.model.enable_weight_tying:
        state.setdefault("lm_head.weight", state.get("tok_embeddings.weight"))
        state.setdefault("tok_embeddings.weight", state.get("lm_head.weight"))
    return state


def hf_checkpoint_problem(directory: str | None) -> str | None:
    """Why `directory` cannot be loaded as an HF checkpoint, or None when it looks loadable."""
    if directory is None:
        return None
    if not Path(directory).is_dir():
        return f"directory {directory!r} not found; allowed: a local Hugging Face model directory"
    if not any(Path(directory).glob("*.safetensors")):
        return f"no *.safetensors files in {directory!r}"
    return None


def require_hf_checkpoint(section: ModelSection, source: str) -> None:
    """Fail before any compute when the configured checkpoint directory is unusable."""
    problem = hf_checkpoint_problem(section.hf_checkpoint)
    if problem:
        raise ConfigError(problem, source=source, where="[model] hf_checkpoint")


def load_hf_checkpoint(spec: ModelSpec, directory: str) -> dict[str, torch.Tensor]:
    """Read *.safetensors of an HF model directory into TorchTitan names via the model's adapter."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    hf_state: dict[str, torch.Tensor] = {}
    for file in files:
        hf_state.update(load_file(str(file)))
    adapter = spec.state_dict_adapter(spec.model, None)
    return _with_tied_alias(spec, adapter.from_hf(hf_state))


@torch.no_grad()
def load_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load full tensors into a (possibly DTensor-sharded) model; each rank keeps its own slice.

    Every rank holds the same `full` (same seed or same file), so slicing is local
    (`src_data_rank=None`). A collective all the same: `state_dict()` gathers fused QKV weights.
    Goes through `load_state_dict` so TorchTitan's hooks (fused QKV, AC wrappers) apply.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    live = model.state_dict()
    missing = sorted(set(live) - set(full))
    unexpected = sorted(set(full) - set(live))
    if missing or unexpected:
        raise KeyError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    state = {}
    for name, target in live.items():
        source = full[name]
        if source.shape != target.shape:
            raise ValueError(f"{name}: shape {tuple(source.shape)} != model {tuple(target.shape)}")
        source = source.to(dtype=target.dtype, device=target.device)
        if isinstance(target, DTensor):
            source = distribute_tensor(
                source, target.device_mesh, target.placements, src_data_rank=None
            )
        state[name] = source
    model.load_state_dict(state, strict=True)
