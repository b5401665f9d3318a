"""The [loss] section: which TorchRL LLM loss to build, and its keyword arguments.

The loss classes are TorchRL's own; this module only maps names to them and checks the keyword
arguments against the class signature before any model is built.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from titan_learner.schema import ConfigError, did_you_mean

if TYPE_CHECKING:
    from torch import nn

    from titan_learner.config import LossSection

# Defaults that differ from TorchRL's: "rlhf" masks with an explicit response mask, which is what
# the batch format carries (TorchRL's "sft" rule assumes a fixed prompt width).
LOSS_DEFAULTS: dict[str, Any] = {"masking_strategy": "rlhf"}
_NOT_CONFIGURABLE = {"actor_network", "device", "self", "kwargs", "args"}


def loss_class(name: str) -> type:
    from torchrl.objectives.llm import DAPO, CISPOLoss, GRPOLoss

    return {"grpo": GRPOLoss, "dapo": DAPO, "cispo": CISPOLoss}[name]


def check_loss_kwargs(section: LossSection, source: str) -> None:
    """Reject keyword arguments the chosen TorchRL loss does not take."""
    allowed = [
        p
        for p in inspect.signature(loss_class(section.name).__init__).parameters
        if p not in _NOT_CONFIGURABLE
    ]
    for key in section.kwargs:
        if key not in allowed:
            raise ConfigError(
                f"unknown key '{key}' for loss '{section.name}'{did_you_mean(key, allowed)}; "
                f"allowed keys: name, {', '.join(sorted(allowed))}",
                source=source,
                where="[loss]",
            )
    eps = section.kwargs.get("clip_epsilon")
    if section.name == "dapo" and not isinstance(eps, list | tuple) and eps is not None:
        raise ConfigError(
            f"dapo takes an asymmetric clip_epsilon = [low, high], got {eps!r}",
            source=source,
            where="[loss] clip_epsilon",
        )


def build_loss(section: LossSection, actor: nn.Module) -> nn.Module:
    """Instantiate the TorchRL loss over `actor` with the configured keyword arguments."""
    kwargs = {**LOSS_DEFAULTS, **section.kwargs}
    if isinstance(kwargs.get("clip_epsilon"), list):
        kwargs["clip_epsilon"] = tuple(kwargs["clip_epsilon"])
    try:
        return loss_class(section.name)(actor, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build loss '{section.name}': {err}", where="[loss]") from err
