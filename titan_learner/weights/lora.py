"""LoRA layers as weights: which tensors are adapters, and a layer's weight with them merged in.

TorchTitan's `LoRALinear` (built by titan_learner.model.lora) keeps its base `weight` frozen
beside two adapter children, `lora_a` and `lora_b`, and holds its scale alpha / rank as
`_lora_scaling`. What leaves the learner for rollout engines and Hugging Face files is the
merged weight W + scale * B A, under the base layer's name: the engines load it as any weight.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

ADAPTER_PARTS = (".lora_a.", ".lora_b.")
"""What names an adapter tensor in a state dict (TorchTitan's LoRALinear children)."""
SCALING = "_lora_scaling"
"""TorchTitan's LoRALinear attribute holding alpha / rank (tests/unit/test_lora.py fails if
TorchTitan renames it)."""


def is_adapter(name: str) -> bool:
    """Whether a state-dict or parameter name is a LoRA adapter tensor's."""
    return any(part in name for part in ADAPTER_PARTS)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The adapted Linear layers of `model`, by module name."""
    for name, module in model.named_modules():
        if hasattr(module, SCALING):
            yield name, module


def uses_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def merged_weight(
    module: nn.Module, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> torch.Tensor:
    """W + scale * B A from whole (gathered) tensors, computed in float32, in W's dtype."""
    scale = getattr(module, SCALING)
    delta = lora_b.float() @ lora_a.float()
    return (weight.float() + scale * delta).to(weight.dtype)
