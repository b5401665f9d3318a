"""The TorchRL methods our losses override, pinned to TorchRL 0.14.1's signatures.

Our loss classes (titan_learner/learner/loss/classes.py: one subclass of its TorchRL class per
loss, over the helpers of losses.py, correction.py, aggregation.py and the published objectives
of gspo.py, cispo.py) override private methods of TorchRL's GRPO family and call them through
super(); each class's docstring lists them, checked here against its MRO. A TorchRL release that renames one, reorders its arguments or changes what it
returns would break the loss silently (the override no longer called) or loudly deep inside a
step. These tests fail first, naming the method, our override and what changed: read TorchRL's
new code for that method before updating its pin.
"""

from __future__ import annotations

import inspect
import re

import pytest
from torchrl.objectives.llm.grpo import DAPO, CISPOLoss, GRPOLoss

from titan_learner.learner.loss.classes import BUILT, PUBLISHED_OBJECTIVES, titan_loss_class

TORCHRL_BASES = (GRPOLoss, DAPO, CISPOLoss)

PROPERTY = "a property"
PINNED: dict[str, str] = {
    "GRPOLoss.__init__": (
        "(self, actor_network: 'LLMWrapperBase | None' = None, *, clip_epsilon: "
        "'float | tuple[float, float]' = 0.2, kl_mask_threshold: 'float | None' = None, "
        "aggregation: 'str | None' = 'token_mean', entropy_bonus: 'bool' = True, "
        "samples_mc_entropy: 'int' = 1, entropy_coeff: 'float' = 0.01, gamma: 'float | None' = "
        "None, reduction: 'str | None' = None, clip_value: 'bool | float | None' = None, "
        "kl_to_ref_coeff: 'float | None' = None, kl_to_inference_coeff: 'float | None' = None, "
        "device: 'torch.device | None' = None, masking_strategy: \"Literal['sft', 'rlhf', "
        "'generic']\" = 'sft', ref_log_prob_padding_side: \"Literal['left', 'right']\" = 'left', "
        "ref_log_prob_padding_value: 'float' = 0.0, **kwargs)"
    ),
    "GRPOLoss.forward": "(self, tensordict: 'TensorDictBase') -> 'LLMOutputType'",
    # TorchRL's loss metaclass gives every class it makes a forward of its own (a wrapper)
    "DAPO.forward": "(self, tensordict: 'TensorDictBase') -> 'LLMOutputType'",
    "CISPOLoss.forward": "(self, tensordict: 'TensorDictBase') -> 'LLMOutputType'",
    "GRPOLoss._kl_to_ref": (
        "(self, tensordict: 'TensorDictBase', key: 'NestedKey' = ('next', 'ref_log_probs'), "
        "ref_log_prob: 'torch.Tensor | None' = None, coeff: 'float | None' = None, mask: "
        "'torch.Tensor | None' = None, dist: 'd.Distribution | None' = None)"
    ),
    "GRPOLoss._log_weight": (
        "(self, tensordict: 'TensorDictBase', adv_shape: 'torch.Size') -> "
        "'tuple[torch.Tensor, d.Distribution, torch.Tensor, torch.Tensor]'"
    ),
    "GRPOLoss._get_entropy": (
        "(self, dist: 'd.Distribution', adv_shape: 'torch.Size') -> 'torch.Tensor | TensorDict'"
    ),
    "GRPOLoss._clip_bounds": PROPERTY,
    "GRPOLoss._aggregate_loss_value": (
        "(self, value: 'torch.Tensor', mask: 'torch.Tensor', tensordict: "
        "'TensorDictBase | None' = None) -> 'torch.Tensor'"
    ),
    "GRPOLoss._get_cur_log_prob": "(self, tensordict)",
    "GRPOLoss._compute_policy_objective": (
        "(self, log_weight: 'torch.Tensor', advantage: 'torch.Tensor') -> "
        "'tuple[torch.Tensor, torch.Tensor]'"
    ),
    "CISPOLoss._compute_policy_objective": (
        "(self, log_weight: 'torch.Tensor', advantage: 'torch.Tensor') -> "
        "'tuple[torch.Tensor, torch.Tensor]'"
    ),
}
"""TorchRL 0.14.1: `Class.method` (where TorchRL defines it) -> its signature."""


def our_overrides() -> dict[str, list[str]]:
    """`Class.method` of TorchRL -> our classes that override it, over every loss we build."""
    found: dict[str, list[str]] = {}
    ours = [titan_loss_class(base) for base in TORCHRL_BASES]
    ours += [titan_loss_class(cls) for cls in PUBLISHED_OBJECTIVES.values()]
    for mixed in ours:
        torchrl_base = next(c for c in mixed.__mro__ if c in TORCHRL_BASES)
        for cls in mixed.__mro__:
            if not cls.__module__.startswith("titan_learner"):
                continue
            for name, value in vars(cls).items():
                if name.startswith("__") and name != "__init__":
                    continue
                if not (callable(value) or isinstance(value, property)):
                    continue
                if not hasattr(torchrl_base, name):
                    continue
                where = defining(torchrl_base, name)
                overrider = f"{cls.__module__}.{cls.__qualname__}"
                if overrider not in found.setdefault(where, []):
                    found[where].append(overrider)
    return found


def defining(cls: type, name: str) -> str:
    """`Class.name` for the TorchRL class in `cls`'s MRO that defines `name`."""
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return f"{owner.__qualname__}.{name}"


def installed(qualified: str) -> str:
    class_name, name = qualified.split(".")
    owner = {c.__qualname__: c for c in TORCHRL_BASES}[class_name]
    raw = inspect.getattr_static(owner, name)
    return PROPERTY if isinstance(raw, property) else str(inspect.signature(getattr(owner, name)))


def test_every_torchrl_method_we_override_is_pinned():
    unpinned = {where: who for where, who in our_overrides().items() if where not in PINNED}
    assert not unpinned, (
        f"these TorchRL methods are overridden without a pin: {unpinned}; add each one's "
        "signature to PINNED after reading TorchRL's code for it"
    )


@pytest.mark.parametrize("qualified", sorted(PINNED))
def test_torchrl_keeps_the_signature_we_override(qualified):
    overriders = our_overrides().get(qualified, [])
    assert overriders, f"{qualified} is pinned but nothing of ours overrides it: drop the pin"
    now = installed(qualified)
    assert now == PINNED[qualified], (
        f"TorchRL changed {qualified}, which {', '.join(overriders)} override(s): pinned "
        f"{PINNED[qualified]}, installed {now}; read TorchRL's new {qualified} before "
        "updating the override and this pin"
    )


def overridden_by(ours: type) -> set[str]:
    """The TorchRL methods `ours` (or a class of ours in its MRO) overrides."""
    torchrl_base = next(c for c in ours.__mro__ if c in TORCHRL_BASES)
    return {
        name
        for cls in ours.__mro__
        if cls.__module__.startswith("titan_learner")
        for name, value in vars(cls).items()
        if (not name.startswith("__") or name == "__init__")
        and (callable(value) or isinstance(value, property))
        and hasattr(torchrl_base, name)
    }


@pytest.mark.parametrize("ours", list(BUILT.values()), ids=lambda cls: cls.__name__)
def test_each_loss_class_lists_the_torchrl_methods_it_overrides(ours):
    listed = ours.__doc__.split("Overrides:")[1]
    named = set(re.findall(r"`(\w+)`", listed))
    assert named == overridden_by(ours), (
        f"{ours.__name__}'s docstring lists {sorted(named)} but it overrides "
        f"{sorted(overridden_by(ours))} of TorchRL"
    )


def test_an_unknown_base_class_is_refused_naming_the_allowed():
    with pytest.raises(ValueError, match=r"no loss class of ours over dict; allowed: GRPOLoss, "):
        titan_loss_class(dict)
