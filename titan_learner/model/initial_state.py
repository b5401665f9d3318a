"""The layout-independent initial weights, and loading them into a (sharded) model.

Initial weights are defined once, independent of the layout: a seeded full initialization (or a
Hugging Face checkpoint converted by TorchTitan's state-dict adapter) that every layout slices
its shards from. That is what makes a dp_shard=2 x tp=2 run start from exactly the weights of a
one-process run, and what parity tests and layout changes rely on.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_learner.config.errors import ConfigError
from titan_learner.model.spec import build_meta
from titan_learner.weights.lora import lora_modules
from titan_learner.weights.matching import match_named_tensors

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config.schema import ModelSection


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
    spec: ModelSpec, section: ModelSection, seed: int, source: str = "<config>"
) -> dict[str, torch.Tensor]:
    """The layout-independent starting weights: an HF checkpoint, or a seeded full init on CPU;
    with [model.lora], seeded adapters beside a base read from a checkpoint or transformers."""
    if section.hf_checkpoint or section.init == "transformers":
        if section.hf_checkpoint:
            state = load_hf_checkpoint(spec, section.hf_checkpoint, source)
        else:
            state = transformers_initial_state(spec, seed)
        if section.lora is not None:
            state.update(initial_adapters(spec, seed))
        return state
    model = build_meta(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        materialize(model, torch.device("cpu"))
    return {k: v for k, v in model.state_dict().items()}


@torch.no_grad()
def initial_adapters(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Seeded starting adapters for a base read from a checkpoint (which has none): each layer's
    own init (Kaiming A, zero B), drawn on the CPU in module order from `seed`, whatever the
    layout, as the rest of the initial state is."""
    model = build_meta(spec)
    state = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, module in lora_modules(model):
            for part in ("lora_a", "lora_b"):
                child = getattr(module, part)
                child.to_empty(device="cpu")
                child.init_states()
                state[f"{name}.{part}.weight"] = child.weight.detach()
    return state


def transformers_initial_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The matching transformers model's own seeded init, converted by TorchTitan's adapter."""
    from transformers import AutoModelForCausalLM

    from titan_learner.model.hf_config import hf_config

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


def load_hf_checkpoint(
    spec: ModelSpec, directory: str, source: str = "<config>"
) -> dict[str, torch.Tensor]:
    """Read *.safetensors of an HF model directory into TorchTitan names via the model's adapter."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    hf_state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            hf_state.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise ConfigError(
                f"{file} is not a readable safetensors file ({type(err).__name__}: {err}); "
                "allowed: the model directory's own, complete *.safetensors files",
                source=source,
                where="[model] hf_checkpoint",
            ) from None
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
    full = match_named_tensors(
        full.items(),
        {name: t.shape for name, t in live.items()},
        floating_point=False,
        rejected="the initial weights do not fit the model",
    )
    state = {}
    for name, target in live.items():
        source = full[name]
        source = source.to(dtype=target.dtype, device=target.device)
        if isinstance(target, DTensor):
            source = distribute_tensor(
                source, target.device_mesh, target.placements, src_data_rank=None
            )
        state[name] = source
    model.load_state_dict(state, strict=True)
