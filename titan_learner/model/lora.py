"""LoRA on TorchTitan's own `LoRAConverter`: adapters in the one build path, and what a run of
them needs beside it (the adapters alone, switched off, started, fingerprinted base).

The converter rewrites the model config before the meta build, so one process, FSDP2, HSDP and
tensor parallel all shard the adapters with the model's own plan (TorchTitan derives each
adapter's TP sharding from its base layer's). A target `Linear` becomes TorchTitan's
`LoRALinear`: the base frozen, `lora_a` (Kaiming) and `lora_b` (zeros) trainable, the output
`W x + scale * B A x` with scale = alpha / rank (titan_learner.weights.lora: which tensors are
adapters, the merged weight). Every other parameter is frozen, so the optimizer holds the
adapters alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_learner.config.errors import ConfigError
from titan_learner.weights.export import checksum_of, unwrapped_name
from titan_learner.weights.lora import SCALING, is_adapter, lora_modules, uses_lora

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

    from titan_learner.config.schema import LoRASection

OUTPUT_HEAD = "lm_head"


def linear_names(model_config) -> list[str]:
    """The names `target_modules` can match: the last part of every Linear's name."""
    from torchtitan.models.common.linear import Linear

    return sorted(
        {fqn.rsplit(".", 1)[-1] for fqn, *_ in model_config.traverse(Linear.Config, recurse=True)}
    )


def apply_lora(spec: ModelSpec, section: LoRASection, source: str = "<config>") -> None:
    """Convert `spec.model` in place with TorchTitan's LoRAConverter, after checking the targets
    against the model's own Linear names (the converter itself only logs a warning)."""
    from torchtitan.components.lora import LoRAConverter

    names = linear_names(spec.model)
    targets = section.target_modules
    if targets is None:
        targets = [name for name in names if name != OUTPUT_HEAD]
    unknown = [name for name in targets if name not in names]
    if unknown or not targets:
        fused = " (q, k and v are one fused Linear, wqkv)" if "wqkv" in names else ""
        what = f"{', '.join(map(repr, unknown))} matches no Linear" if unknown else "no target"
        raise ConfigError(
            f"{what} of the {spec.name} model; allowed: one or more of {', '.join(names)}{fused}",
            source=source,
            where="[model.lora] target_modules",
        )
    if OUTPUT_HEAD in targets and spec.model.enable_weight_tying:
        raise ConfigError(
            f"lm_head shares its weight with the embedding in this {spec.name} model (tied), "
            "which Hugging Face's format and vLLM keep as one tensor; allowed: targets other "
            f"than lm_head ({', '.join(n for n in names if n != OUTPUT_HEAD)})",
            source=source,
            where="[model.lora] target_modules",
        )
    converter = LoRAConverter(
        LoRAConverter.Config(rank=section.rank, alpha=section.alpha, target_modules=targets)
    )
    spec.model = converter.convert(spec.model)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model for the duration: every adapter's scale 0, so each adapted layer returns
    its base output exactly (W x + 0 * B A x), in the model's own forward and sharding; no
    second copy of the weights (the KL reference of a LoRA run)."""
    modules = [module for _, module in lora_modules(model)]
    scales = [getattr(module, SCALING) for module in modules]
    for module in modules:
        setattr(module, SCALING, 0.0)
    try:
        yield
    finally:
        for module, scale in zip(modules, scales, strict=True):
            setattr(module, SCALING, scale)


def base_fingerprint(full_state: dict[str, torch.Tensor]) -> str:
    """An xxh3 checksum of the base weights (every tensor but the adapters, by name): which
    base a run's adapters were trained on, compared before they are loaded again."""
    base = [(name, full_state[name]) for name in sorted(full_state) if not is_adapter(name)]
    return checksum_of(base)


def checkpointed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of `model`: its state dict; with LoRA the adapters alone (the
    frozen base is the run's initial weights, recorded by fingerprint: checkpoint.lora_base),
    taken from the parameters, so no base tensor is gathered to save them."""
    if not uses_lora(model):
        return model.state_dict()
    return {
        unwrapped_name(name): param.detach()
        for name, param in model.named_parameters()
        if is_adapter(name)
    }


def load_checkpointed_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what `checkpointed_state` returned: every tensor of it, none missing or extra."""
    if not uses_lora(model):
        model.load_state_dict(state, strict=True)
        return
    result = model.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if is_adapter(name)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"LoRA adapters do not fit the model: missing {missing}, unexpected "
            f"{result.unexpected_keys}; allowed: the adapters of the same [model.lora] targets"
        )
