"""The one check that named tensors fit their receiver, and the one error every receiver raises.

Every place weights arrive goes through `match_named_tensors` before it changes anything: the
initial state loaded into a (sharded) model, an export checked against its manifest, an
in-process transformers model or generator, a vLLM engine's parameter list. A receiver that
raises `WeightsError` keeps its previous weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn


class WeightsError(ValueError):
    """Weights that do not fit their receiver, or an export that did not arrive whole and intact.

    Raised before the receiver changes anything: it keeps its previous weights (a sink that
    could not keep that promise says so in the message).
    """


def match_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    shapes: Mapping[str, Sequence[int]],
    *,
    required: Iterable[str] | None = None,
    tied: Mapping[str, str] | None = None,
    floating_point: bool = True,
    receiver: str = "the model",
    rejected: str = "the weights were rejected, nothing was copied",
) -> dict[str, torch.Tensor]:
    """Collect `named` and check it against a receiver's `shapes`; return `{name: tensor}`.

    required: the names that must be present (default: every name in `shapes`).
    tied: `{alias: parameter}` pairs that are one tensor in the receiver: an alias is accepted
    (even when `shapes` does not list it) and must equal its parameter when both are sent.
    floating_point: every tensor must be floating point (weights, not buffers of ids).
    The iterable is consumed whole first; every problem is named in one WeightsError,
    `"<rejected>: <problem> | <problem> ..."`.
    """
    tied = dict(tied or {})
    incoming: dict[str, torch.Tensor] = {}
    repeated = []
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"{rejected}: {name!r} is a {type(tensor).__name__}, not a tensor")
        if name in incoming:
            repeated.append(name)
        incoming[name] = tensor
    problems = []
    if repeated:
        problems.append(f"repeated names: {_names(repeated)}")
    unknown = [n for n in incoming if n not in shapes and tied.get(n) not in shapes]
    if unknown:
        problems.append(f"unknown names (not parameters of {receiver}): {_names(unknown)}")
    missing = [n for n in (shapes if required is None else required) if n not in incoming]
    if missing:
        problems.append(f"missing parameters: {_names(missing)} ({len(missing)} in all)")
    wrong = [
        f"{n}: got {tuple(t.shape)}, {receiver} has {tuple(shapes[n])}"
        for n, t in incoming.items()
        if n in shapes and tuple(t.shape) != tuple(shapes[n])
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:5]) + _more(wrong, 5))
    differ = [
        f"{alias} is tied to {parameter} in {receiver}: they are one tied parameter but the "
        "tensors sent differ"
        for alias, parameter in tied.items()
        if alias in incoming
        and parameter in incoming
        and not torch.equal(incoming[alias], incoming[parameter])
    ]
    problems.extend(differ)
    if floating_point:
        not_float = [n for n, t in incoming.items() if not t.is_floating_point()]
        if not_float:
            problems.append(f"non-floating-point tensors: {_names(not_float)}")
    if problems:
        raise WeightsError(f"{rejected}: " + " | ".join(problems))
    return incoming


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """`{alias: parameter}` for the state-dict names that share a parameter with another
    (e.g. `lm_head.weight` of a model with tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
    return aliases


@torch.no_grad()
def copy_into_module(
    module: nn.Module, named: Iterable[tuple[str, torch.Tensor]], *, rejected: str
) -> None:
    """Copy named tensors into `module`'s parameters in place (cast to their dtype/device).

    Every parameter must be sent with its shape (a tied alias may be sent too, equal to its
    parameter); nothing is copied unless everything fits.
    """
    targets = {
        name: t
        for name, t in module.state_dict(keep_vars=True).items()
        if isinstance(t, nn.Parameter)
    }
    incoming = match_named_tensors(
        named,
        {name: t.shape for name, t in targets.items()},
        required=[name for name, _ in module.named_parameters()],
        tied=tied_aliases(module),
        rejected=rejected,
    )
    for name, tensor in incoming.items():
        targets[name].copy_(tensor)


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + _more(names, limit)


def _more(items: list, limit: int) -> str:
    return f" (and {len(items) - limit} more)" if len(items) > limit else ""
