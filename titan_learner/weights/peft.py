"""LoRA adapters as PEFT tensors: the format users share (`adapter_model.safetensors` beside an
`adapter_config.json`) and vLLM serves as a LoRA adapter.

TorchTitan's adapter pair on a layer maps onto Hugging Face's modules the way the base weight
does: its B takes the rows its weight's conversion takes (the fused QKV split into q, k and v,
Llama's q/k RoPE permutation), found by running that conversion on a weight of row indices; its
A, which works on the layer's input, goes whole to each of them. So one pair on TorchTitan's
fused `wqkv` is exactly PEFT's three pairs on q_proj, k_proj and v_proj, sharing A.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_learner.weights.export import lora_layers, whole_adapters

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

PEFT_PREFIX = "base_model.model."
"""Where PEFT's LoraModel puts the wrapped causal LM's own names."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def hf_rows(
    to_hf: Callable[[torch.Tensor], dict[str, torch.Tensor]], shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """For each Hugging Face tensor a TorchTitan weight of `shape` becomes: the weight's rows it
    takes, in order (the conversion run on a weight whose every row holds its own index)."""
    rows = torch.arange(shape[0], dtype=torch.float32).unsqueeze(1).expand(shape).contiguous()
    return {name: tensor[:, 0].round().long() for name, tensor in to_hf(rows).items()}


def iter_peft_tensors(model: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, whole tensor) of every adapter, `...q_proj.lora_A.weight` and `lora_B`:
    A as it is for each module its layer becomes, B's rows as the base weight's go. A collective
    on sharded models (each adapter is gathered): every rank iterates to the end."""
    adapter = spec.state_dict_adapter(spec.model, None)
    layouts = _LAYOUTS.setdefault(model, {})  # the layers of a stack share theirs; kept
    for name, owner, shape, to_state_dict in lora_layers(model):
        layer = re.search(r"\d+", name)
        key = (re.sub(r"\d+", "{}", name, count=1), shape)
        if key not in layouts:
            rows = hf_rows(lambda w, convert=to_state_dict: adapter.to_hf(convert(w)), shape)
            layouts[key] = {_template(hf, layer): taken for hf, taken in rows.items()}
        lora_a, lora_b = whole_adapters(owner)
        for template, taken in layouts[key].items():
            hf_name = template.format(layer.group(0)) if layer else template
            module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            yield f"{module}.lora_A.weight", lora_a.clone()
            yield f"{module}.lora_B.weight", lora_b.index_select(0, taken)


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
"""Per model, each kind of layer's Hugging Face names and rows: made at its first export, a
conversion of a weight-sized tensor per kind, then read at every push."""


def _template(hf_name: str, layer: re.Match | None) -> str:
    """A Hugging Face name with its layer's number as a placeholder (TorchTitan's adapters
    number layers as Hugging Face does)."""
    return hf_name.replace(layer.group(0), "{}", 1) if layer else hf_name


def peft_config(rank: int, alpha: float, names: list[str], base: str | None) -> dict[str, Any]:
    """PEFT's adapter_config.json for the adapters `names` (PEFT names) hold: LoRA of `rank`,
    scale alpha / rank (PEFT's lora_alpha / r, rsLoRA off), on the Hugging Face modules they
    name, over the model `base` (its directory; None for a base made from a seed)."""
    suffix = ".lora_A.weight"
    modules = {n.removesuffix(suffix).rsplit(".", 1)[-1] for n in names if n.endswith(suffix)}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
