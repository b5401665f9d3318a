"""Sharded DCP checkpoints of a Learner: atomic, resumable on the same or another layout.

On disk, under one checkpoint root directory:

    <root>/step-<N>/       a committed checkpoint: DCP's `.metadata`, one `__<rank>_0.distcp`
                           per rank, `checksums.json` (checkpoint.integrity)
    <root>/step-<N>.tmp/   a save in progress, or one that died mid-way: never loaded
    <root>/latest          the name of the newest committed step directory, written last

A shard file is a sequence of records: each tensor shard as its raw bytes (checkpoint.records;
dtype, shape and offsets in the global tensor are DCP's metadata), each plain value as DCP's
torch.save of it. Checkpoints written before raw records (torch.save records) load too.

`save` and `load` are collectives: every rank calls them, in the same order. Each rank writes and
reads only its own shards; DCP reshards on load, so a checkpoint written at dp_shard=4 loads at
dp_shard=2 x tp=2, or into a one-process `LocalLearner` as plain tensors.

What is saved is `Learner.checkpoint()` (model and optimizer shards, LR scheduler, stepper
counters, loss-owned parameters and buffers, step, policy version) plus each rank's RNG states
and, where a caller gives them, plain values (`extra`) and each rank's own tensors (`local`).

Loading runs no pickled code (see `titan_learner.checkpoint.safe_read`).

The module imports torch.distributed.checkpoint at import time; the Learner imports this module
lazily, so DCP stays out of the import path of code that never checkpoints.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titan_learner.checkpoint.agreement import (
    checkpoint_group,
    dcp_call,
    everywhere,
    join,
    on_rank0,
)
from titan_learner.checkpoint.async_save import (
    AlreadyStaged,
    SaveHandle,
    on_cpu,
    set_pending,
    then_commit,
    wait_for_pending_save,
)
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.layout import commit, prepare, step_dir, tmp_dir
from titan_learner.checkpoint.packing import saved_unpacked, unpack_param_groups
from titan_learner.checkpoint.records import RawWriter
from titan_learner.checkpoint.safe_read import SafeLoadPlanner, SafeReader, open_step
from titan_learner.ranks import rank, world_size

RNG_KEY = "rng"
EXTRA_KEY = "extra"
"""Plain values a caller saves beside the learner (the job's data position)."""
LOCAL_KEY = "local"
"""Tensors each rank saves for itself (the job's queued rollouts), under its own key."""
DEFAULT_TIMEOUT_S = 1800.0
"""Long enough for the slowest rank's write of a large model: DCP's collectives wait for it."""


class Checkpointable(Protocol):
    """What save and load need of a learner (the Learner contract's state methods)."""

    step: int

    def checkpoint(self, *, clone: bool = True) -> dict[str, Any]: ...

    def load_checkpoint(self, state: dict[str, Any]) -> None: ...


def _describe(shape: tuple[int, ...] | None) -> str:
    return "a non-tensor value" if shape is None else f"shape {shape}"


def _listed(title: str, items: list[str], limit: int = 8) -> str:
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return f"{len(items)} {title}: {', '.join(items[:limit])}{more}"


def _check_fits(path: Path, state: dict[str, Any], metadata: Metadata) -> None:
    """Compare what this learner will load with what the checkpoint holds, before reading.

    Keys are DCP's flattened names (`model.<fqn>`, `optimizer.state.<fqn>.exp_avg`, ...); a
    tensor is compared by its global shape, so any layout fits any other of the same model.
    """
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    missing, mismatched = [], []
    for key, value in flat.items():
        entry = saved.get(key)
        if entry is None:
            missing.append(key)
            continue
        here = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        there = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if here != there:
            mismatched.append(f"{key} ({_describe(there)} saved, {_describe(here)} here)")
    optional = (f"{RNG_KEY}.", f"{EXTRA_KEY}.", f"{LOCAL_KEY}.")  # restored only when asked for
    extra = sorted(k for k in saved if k not in flat and not k.startswith(optional))
    if missing or mismatched or extra:
        parts = [
            _listed(title, items)
            for title, items in (
                ("mismatched", mismatched),
                ("missing from the checkpoint", missing),
                ("only in the checkpoint", extra),
            )
            if items
        ]
        raise CheckpointError(
            f"checkpoint {path} does not fit this learner (another model, loss or optimizer "
            f"config?): {'; '.join(parts)}"
        )


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def _checked_local(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, value in local.items():
        if "." in name or not isinstance(value, torch.Tensor):
            raise ValueError(f"local entries are tensors under names without dots, got {name!r}")
    return dict(local)


def _state(learner: Checkpointable, clone: bool) -> dict[str, Any]:
    """`learner.checkpoint()` plus this rank's RNG states, under a key only this rank writes.

    RNG states differ per rank; DCP would keep one copy of a key every rank saves, so each rank
    saves `rng.rank<r>.<device>`. clone=False (a synchronous save: training waits for it)
    writes the live tensors, without copying the state first.
    """
    state = learner.checkpoint(clone=clone)
    for reserved in (RNG_KEY, EXTRA_KEY, LOCAL_KEY):
        if reserved in state:
            raise CheckpointError(
                f"Learner.checkpoint() returned a '{reserved}' entry; it is reserved"
            )
    state[RNG_KEY] = {_rank_key(rank()): _rng_states()}
    return state


def _saved_ranks(metadata: Metadata) -> set[str]:
    return {
        key.split(".")[1] for key in metadata.state_dict_metadata if key.startswith(f"{RNG_KEY}.")
    }


def _template(learner: Checkpointable, metadata: Metadata, with_local: bool) -> dict[str, Any]:
    """What to load into: the learner's own live state (right layout, right shapes; loaded in
    place, so `load_checkpoint` copies nothing more), RNG slots and, `with_local`, slots for
    this rank's `local` tensors (shapes and dtypes from the metadata).

    Per-rank state is restored only when the checkpoint was saved by a world of the same size:
    otherwise ranks do not correspond and the state is left as it is (with a warning).
    """
    state = learner.checkpoint(clone=False)
    optimizer_keys = [
        key.removeprefix("optimizer.")
        for key in metadata.state_dict_metadata
        if key.startswith("optimizer.")
    ]
    if isinstance(state.get("optimizer"), dict) and saved_unpacked(optimizer_keys):
        state["optimizer"] = unpack_param_groups(state["optimizer"])  # saved before the packing
    saved_ranks = _saved_ranks(metadata)
    if len(saved_ranks) != world_size():
        local = with_local and any(
            k.startswith(f"{LOCAL_KEY}.") for k in metadata.state_dict_metadata
        )
        if rank() == 0:
            warnings.warn(
                f"RNG states not restored: the checkpoint was saved by {len(saved_ranks)} "
                f"rank(s), this world has {world_size()}; RNG states are per rank"
                + (", and so are the ranks' local tensors, not restored either" if local else ""),
                stacklevel=3,
            )
        return state
    key = _rank_key(rank())
    slots = {
        kind: torch.empty_like(current)
        for kind, current in _rng_states().items()
        if f"{RNG_KEY}.{key}.{kind}" in metadata.state_dict_metadata
    }
    if slots:
        state[RNG_KEY] = {key: slots}
    prefix = f"{LOCAL_KEY}.{key}."
    local = {
        name.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if with_local and name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if local:
        state[LOCAL_KEY] = {key: local}
    return state


def _restore_rng(rng: dict[str, dict[str, torch.Tensor]] | None) -> None:
    for states in (rng or {}).values():
        if "cpu" in states:
            torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])


def _check_options(keep_latest_k: int, timeout: float) -> None:
    if not isinstance(keep_latest_k, int) or keep_latest_k < 0:
        raise ValueError(f"keep_latest_k must be an int >= 0 (0 keeps all), got {keep_latest_k!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


def save(
    learner: Checkpointable,
    directory: str | os.PathLike,
    *,
    keep_latest_k: int = 0,
    asynchronous: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    extra: dict[str, Any] | None = None,
    local: dict[str, torch.Tensor] | None = None,
) -> SaveHandle:
    """Save `learner` at its current step into `directory/step-<step>` (a collective).

    Every rank writes its own shards into `step-<N>.tmp`; DCP's final collective gathers every
    rank's write results on rank 0 before it writes `.metadata`, so when rank 0's write returns
    every shard is on disk. Only then does rank 0 rename the directory to `step-<N>`, write
    `latest` (temp file + os.replace) and keep the newest `keep_latest_k` steps (0: all).

    asynchronous=True returns once the state is copied (training may go on); the write, and
    the commit after it, run in a background thread. Call `handle.wait()` on every rank before
    relying on the checkpoint; the next save or load waits for it first.

    timeout: seconds any checkpoint collective may wait for the other ranks, including for the
    slowest rank's write; a rank that never calls save ends the job after it with
    CheckpointTimeoutError naming the operation.

    extra: plain values (ints, floats, strings, nested dicts of them) saved beside the learner,
    the same on every rank (e.g. the job's data position); `load(..., extra=template)` reads
    them back.

    local: this rank's own tensors (names without dots; any shapes, different on each rank),
    e.g. the job's queued rollouts; `load(..., local={})` reads them back into the same world
    size.
    """
    _check_options(keep_latest_k, timeout)
    local = _checked_local(local) if local else None
    wait_for_pending_save()
    root, step = Path(directory), int(learner.step)
    operation = f"checkpoint save of step {step} to {root}"
    group = checkpoint_group(timeout)
    join(group, timeout, operation)
    on_rank0(group, operation, lambda: prepare(root, step))
    state = _state(learner, clone=asynchronous)
    if extra:
        state[EXTRA_KEY] = extra
    if local:
        state[LOCAL_KEY] = {_rank_key(rank()): local}
    writer = RawWriter(tmp_dir(root, step))
    no_dist = group is None
    commit_step = lambda: commit(root, step, keep_latest_k)  # noqa: E731
    discard_step = lambda: shutil.rmtree(tmp_dir(root, step), ignore_errors=True)  # noqa: E731
    if not asynchronous:
        try:
            with dcp_call(operation, no_dist):
                dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
        except CheckpointError:
            if rank() == 0:  # a full disk: free what the failed write took; `latest` is intact
                discard_step()
            raise
        on_rank0(group, operation, commit_step)
        return SaveHandle(step_dir(root, step), operation)
    with dcp_call(operation, no_dist):
        upload = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=group,
            async_stager=AlreadyStaged() if on_cpu(state) else None,
            no_dist=no_dist,
        )
    future = then_commit(upload, commit_step, discard_step) if rank() == 0 else upload
    handle = SaveHandle(step_dir(root, step), operation, group, future)
    set_pending(handle)
    return handle


# -- load ----------------------------------------------------------------------------------------


def load(
    learner: Checkpointable,
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    extra: dict[str, Any] | None = None,
    local: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Restore `learner` from the checkpoint `latest` names (or `step`) in `directory`.

    A collective. Works across layouts and into a one-process learner: each rank reads the
    pieces of every saved shard that overlap its own. Before reading any tensor, the
    checkpoint's metadata is checked against this learner: missing, mismatched or extra keys
    raise CheckpointError listing them. Returns the step directory loaded.

    extra: a dict shaped like the one `save` was given; its values are replaced in place by
    the saved ones (a checkpoint without them raises CheckpointError naming the keys).

    local: a dict this rank's saved `local` tensors are put into, when the checkpoint was
    saved by a world of this size (left empty otherwise, or when it holds none).
    """
    _check_options(0, timeout)
    wait_for_pending_save()
    root = Path(directory)
    operation = f"checkpoint load from {root}"
    group = checkpoint_group(timeout)
    join(group, timeout, operation)
    path, metadata, checksums = everywhere(group, operation, lambda: open_step(root, step))
    operation = f"checkpoint load of {path}"
    state = _template(learner, metadata, with_local=local is not None)
    if extra:
        state[EXTRA_KEY] = extra  # filled in place with the saved values
    everywhere(group, operation, lambda: _check_fits(path, state, metadata))
    with dcp_call(operation, group is None):
        dcp.load(
            state,
            storage_reader=SafeReader(path, metadata, checksums, group),
            planner=SafeLoadPlanner(),
            process_group=group,
            no_dist=group is None,
        )
    rng = state.pop(RNG_KEY, None)
    state.pop(EXTRA_KEY, None)
    if local is not None:
        local.update(state.pop(LOCAL_KEY, {}).get(_rank_key(rank()), {}))
    learner.load_checkpoint(state)
    _restore_rng(rng)
    return path
