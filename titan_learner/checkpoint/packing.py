"""An optimizer's per-parameter settings packed into one checkpoint record.

DCP writes every non-tensor leaf of a state dict as a record of its own (its own torch.save on
save, its own torch.load on load). TorchTitan's flattened optimizer state holds one
`param_groups.<param>.<setting>` value per parameter and setting: 204 of the 255 optimizer
entries of a 2-layer llama, 378 of the 513 records of a 7 M-parameter checkpoint, and most of
the time a small state takes to save and load. Packed into one list of `(name, value)` pairs (a
list of plain values is a single leaf to DCP) they cost one record, and still load on any
layout: they are the same on every rank.
"""

from __future__ import annotations

from typing import Any

PARAM_GROUPS = "param_groups"
_PREFIX = f"{PARAM_GROUPS}."


def pack_param_groups(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict with its `param_groups.*` values as one entry."""
    packed = {key: value for key, value in flat.items() if not key.startswith(_PREFIX)}
    packed[PARAM_GROUPS] = [
        (key.removeprefix(_PREFIX), value) for key, value in flat.items() if key.startswith(_PREFIX)
    ]
    return packed


def unpack_param_groups(state: dict[str, Any]) -> dict[str, Any]:
    """The flattened form back (a state that was never packed is returned as it is)."""
    pairs = state.get(PARAM_GROUPS)
    if not isinstance(pairs, list):
        return dict(state)
    flat = {key: value for key, value in state.items() if key != PARAM_GROUPS}
    flat.update((f"{_PREFIX}{key}", value) for key, value in pairs)
    return flat


def saved_unpacked(optimizer_keys: Any) -> bool:
    """Whether a checkpoint's optimizer keys (without the `optimizer.` prefix) hold the
    per-parameter settings one record each, as checkpoints written before the packing do."""
    return any(key.startswith(_PREFIX) for key in optimizer_keys)
