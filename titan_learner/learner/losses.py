"""The [loss] section built: TorchRL's own loss class over the learner's policy.

Which class a name means, and the check of its keyword arguments, are config validation
(`titan_learner.config.validate`); this module only instantiates it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.validate import loss_class

if TYPE_CHECKING:
    from torch import nn

    from titan_learner.config.schema import LossSection

# Defaults that differ from TorchRL's: "rlhf" masks with an explicit response mask, which is what
# the batch format carries (TorchRL's "sft" rule assumes a fixed prompt width).
LOSS_DEFAULTS: dict[str, Any] = {"masking_strategy": "rlhf"}


def build_loss(section: LossSection, actor: nn.Module) -> nn.Module:
    """Instantiate the TorchRL loss over `actor` with the configured keyword arguments."""
    kwargs = {**LOSS_DEFAULTS, **section.kwargs}
    if isinstance(kwargs.get("clip_epsilon"), list):
        kwargs["clip_epsilon"] = tuple(kwargs["clip_epsilon"])
    try:
        return loss_class(section.name)(actor, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"cannot build loss '{section.name}': {err}", where="[loss]") from err
