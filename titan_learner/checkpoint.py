"""Sharded DCP checkpoints of a Learner: atomic, resumable on the same or another layout.

On disk, under one checkpoint root directory:

    <root>/step-<N>/       a committed checkpoint (DCP: `.metadata` + `__<rank>_<i>.distcp`)
    <root>/step-<N>.tmp/   a save in progress, or one that died mid-way: never loaded
    <root>/latest          the name of the newest committed step directory, written last

`save` and `load` are collectives: every rank calls them, in the same order. Each rank writes and
reads only its own shards; DCP reshards on load, so a checkpoint written at dp_shard=4 loads at
dp_shard=2 x tp=2, or into a one-process `LocalLearner` as plain tensors.

What is saved is `Learner.checkpoint()` (model and optimizer shards, LR scheduler, stepper
counters, loss-owned parameters and buffers, step, policy version) plus each rank's RNG states.

Loading runs no pickled code, which DCP alone does not guarantee in torch 2.13:
- `FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`: no weights_only,
  no safe-globals list. We read it with a restricted unpickler that resolves only DCP's own
  metadata types (the same file format, not a new one).
- `DefaultLoadPlanner.load_bytes` reads non-tensor entries with `torch.load(weights_only=False)`.
  We load them with `weights_only=True` (our non-tensor entries are plain ints, floats, lists).
- Tensor payloads are read with `torch.load(weights_only=True)` by DCP itself.

The module imports torch.distributed.checkpoint at import time; the Learner imports this module
lazily, so DCP stays out of the import path of code that never checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

if TYPE_CHECKING:
    from titan_learner.learner import Learner

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CheckpointError",
    "CheckpointTimeoutError",
    "SaveHandle",
    "committed_steps",
    "latest",
    "load",
    "read_metadata",
    "resolve",
    "save",
    "wait_for_pending_save",
]

T = TypeVar("T")

LATEST = "latest"
METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
RNG_KEY = "rng"
DEFAULT_TIMEOUT_S = 1800.0
"""Long enough for the slowest rank's write of a large model: DCP's collectives wait for it."""

_STEP_NAME = re.compile(r"^step-(\d+)$")
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read: what is wrong, where, and what is allowed."""


class CheckpointTimeoutError(CheckpointError):
    """A collective checkpoint operation that not every rank joined within the timeout."""


# -- paths and the `latest` pointer ------------------------------------------------------------


def _step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}{TMP_SUFFIX}"


def committed_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a committed directory (`step-<N>` holding DCP metadata), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_NAME.match(entry.name)
        if match and (entry / METADATA).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(root: str | os.PathLike) -> Path | None:
    """The committed step directory `<root>/latest` names, or None when nothing was committed.

    The pointer only ever names a directory that was renamed from `.tmp` after every rank had
    written, so an interrupted save is never returned.
    """
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not _STEP_NAME.match(name):
        raise CheckpointError(
            f"{pointer} names '{name}', not a step directory; allowed: 'step-<N>' "
            "(the file is written by save(); do not edit it)"
        )
    return Path(root) / name


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable, not just visible."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` atomically: a reader sees the old name or the new one, whole."""
    tmp = root / f".{LATEST}.{os.getpid()}{TMP_SUFFIX}"
    with open(tmp, "w") as file:
        file.write(name + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prepare(root: Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty `step-<N>.tmp`, with stale leftovers removed."""
    root.mkdir(parents=True, exist_ok=True)
    final = _step_dir(root, step)
    current = latest(root)
    if current is not None and current.name == final.name:
        raise CheckpointError(
            f"step {step} is already the latest committed checkpoint in {root}, and a committed "
            "checkpoint cannot be replaced atomically; allowed: save at a step not saved yet, "
            f"another directory, or remove {final} (and {root / LATEST}) first"
        )
    if final.exists():  # not what `latest` names: left by a save interrupted before its pointer
        shutil.rmtree(final)
    tmp = _tmp_dir(root, step)
    if tmp.exists():  # a save of this step that died before its commit
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _commit(root: Path, step: int, keep_latest_k: int) -> Path:
    """Rank 0, once every rank's shards and the metadata are on disk: rename, then `latest`."""
    tmp, final = _tmp_dir(root, step), _step_dir(root, step)
    if not (tmp / METADATA).is_file():
        raise CheckpointError(f"{tmp} has no {METADATA} after the save; nothing was committed")
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    _rotate(root, keep_latest_k, step)
    return final


def _rotate(root: Path, keep_latest_k: int, current: int) -> None:
    """Keep the newest `keep_latest_k` committed steps (0 keeps all); drop dead `.tmp` saves."""
    if keep_latest_k > 0:
        for step in committed_steps(root)[:-keep_latest_k]:
            if step != current:
                shutil.rmtree(_step_dir(root, step), ignore_errors=True)
    for entry in root.iterdir():
        name = entry.name.removesuffix(TMP_SUFFIX)
        match = _STEP_NAME.match(name)
        if entry.name.endswith(TMP_SUFFIX) and match and int(match.group(1)) < current:
            shutil.rmtree(entry, ignore_errors=True)  # saves are sequential: this one died


def resolve(root: str | os.PathLike, step: int | None = None) -> Path:
    """The committed step directory to load: `step`, else what `latest` names.

    `root` may also be a step directory itself (it holds `.metadata`).
    """
    root = Path(root)
    if step is not None:
        path = _step_dir(root, step)
        if not path.is_dir():
            raise CheckpointError(
                f"no checkpoint of step {step} in {root}; committed steps: {committed_steps(root)}"
            )
    elif (root / METADATA).is_file() or root.name.endswith(TMP_SUFFIX):
        path = root
    elif (root / LATEST).is_file():
        path = latest(root)
    elif _STEP_NAME.match(root.name) or any(root.glob("*.distcp")):
        path = root  # a step directory that lost its metadata: named below
    else:
        raise CheckpointError(
            f"no checkpoint in {root}: no '{LATEST}' pointer (a checkpoint root) and no "
            f"{METADATA} file (a step directory); committed steps: {committed_steps(root)}"
        )
    if path.name.endswith(TMP_SUFFIX):
        raise CheckpointError(
            f"{path} is an uncommitted save (it died or is still running); allowed: a committed "
            f"step directory, or the checkpoint root to load what '{LATEST}' names"
        )
    if not (path / METADATA).is_file():
        raise CheckpointError(
            f"{path} is not a loadable DCP checkpoint: its {METADATA} file is missing (the save "
            "that wrote it did not finish, or the file was removed)"
        )
    return path


# -- reading without running pickled code ------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle that names a callable outside DCP's metadata types."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata types (and torch dtypes), so unpickling cannot run code.

    The stdlib's "restricting globals" recipe: every callable a pickle can invoke comes from
    `find_class`, and the allowed ones only build plain records.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"{module}.{name} is not a DCP metadata type")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's `.metadata` of a step directory, unpickled with DCP's own types only."""
    file = Path(path) / METADATA
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a DCP checkpoint: it has no {METADATA} file"
        ) from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _ForbiddenGlobal as err:
        raise CheckpointError(
            f"{file} refused: {err}; unpickling it could run arbitrary code. Allowed: the "
            "metadata DCP writes (torch.distributed.checkpoint.metadata types, torch.Size, dtypes)"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{file} is unreadable ({type(err).__name__}: {err}); it is truncated or not DCP metadata"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


_WEIGHTS_ONLY_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the doc")


def _unpickling_reason(err: BaseException) -> str:
    """The line of torch's weights_only error that says what was refused, not its advice."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reasons = [line for line in lines if not line.startswith(_WEIGHTS_ONLY_BOILERPLATE)]
    return (reasons or lines or [type(err).__name__])[0]


class _SafeReader(FileSystemReader):
    """DCP's file reader, handed the metadata we already read safely (not `pickle.load`).

    It also remembers which shard file it is reading, so a corrupted one is named.
    """

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._reading = "?"

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"shard file {Path(self.path) / self._reading} is corrupted: a record in it "
                f"could not be read ({type(err).__name__}: {_unpickling_reason(err)})"
            ) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                "rank-local DCP metadata (use_collectives=False) is not supported"
            )
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"checkpoint entry '{fqn}' refused: it needs unsafe unpickling "
                f"({_unpickling_reason(err)}). Allowed: "
                "plain values (numbers, strings, lists, dicts, tensors), which is all save() writes"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _check_shard_files(path: Path, metadata: Metadata) -> None:
    """Every shard file the metadata names exists, sits in `path` and is long enough."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if Path(name).name != name:
            problems.append(f"'{name}' is not a file name inside the checkpoint directory")
        elif not file.is_file():
            problems.append(f"{name} is missing")
        elif (actual := file.stat().st_size) < size:
            problems.append(
                f"{name} is truncated: {actual} bytes, the metadata expects at least {size}"
            )
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}")


def _open(root: Path, step: int | None) -> tuple[Path, Metadata]:
    path = resolve(root, step)
    metadata = read_metadata(path)
    _check_shard_files(path, metadata)
    return path, metadata


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
    extra = sorted(k for k in saved if k not in flat and not k.startswith(f"{RNG_KEY}."))
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


# -- process group and agreement across ranks ---------------------------------------------------

_GROUPS: dict[tuple[int, float], dist.ProcessGroup] = {}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _checkpoint_group(timeout: float) -> dist.ProcessGroup | None:
    """A gloo group over every rank whose collectives fail after `timeout` seconds.

    Checkpoint collectives get their own group so that a rank that never joins a save ends the
    job with an error naming the operation instead of hanging on the training group's timeout;
    gloo also lets `dcp.async_save` run its collectives from a background thread, on CUDA jobs
    too. Created on first use (a collective over the world): every rank must pass the same
    timeout.
    """
    if not _distributed():
        return None
    key = (id(dist.group.WORLD), float(timeout))
    if key not in _GROUPS:
        try:
            _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except Exception as err:
            raise CheckpointTimeoutError(
                f"creating the checkpoint process group (gloo, timeout {timeout:g} s) failed: "
                f"{_first_line(err)}. Not every rank called save()/load() (collectives), or "
                "not with the same timeout"
            ) from err
    return _GROUPS[key]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _join(group: dist.ProcessGroup | None, timeout: float, operation: str) -> None:
    """Every rank enters `operation`, or rank 0 names the ones that did not, after `timeout`."""
    if group is None:
        return
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        raise CheckpointTimeoutError(
            f"{operation}: not every rank joined within {timeout:g} s ({_first_line(err)}). "
            "save() and load() are collectives: every rank must call them, in the same order"
        ) from err


def _agree(group: dist.ProcessGroup | None, operation: str, error: BaseException | None) -> None:
    """One rank's failure becomes every rank's failure, so no rank walks on into a collective."""
    if group is None:
        if error is not None:
            raise error
        return
    reports: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(reports, mine, group=group)
    except RuntimeError as err:
        raise CheckpointTimeoutError(
            f"{operation}: ranks could not agree on the outcome ({_first_line(err)})"
        ) from err
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        rank, report = failed[0]
        raise CheckpointError(f"{operation} failed on rank {rank}: {report}")


def _everywhere(group: dist.ProcessGroup | None, operation: str, fn: Callable[[], T]) -> T:
    """Run `fn` on this rank; raise on every rank if it raised on any."""
    try:
        result, error = fn(), None
    except Exception as err:
        result, error = None, err
    _agree(group, operation, error)
    return result  # type: ignore[return-value]


def _on_rank0(group: dist.ProcessGroup | None, operation: str, fn: Callable[[], T]) -> T | None:
    return _everywhere(group, operation, fn if _rank() == 0 else lambda: None)


def _dcp_error(operation: str, err: BaseException) -> CheckpointError:
    """DCP gathers every rank's exception into one CheckpointException: name rank and cause."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, CheckpointException) and err.failures:
        cause, _trace = err.failures[min(err.failures)]
        if isinstance(cause, CheckpointError):
            return CheckpointError(f"{operation}: {cause}")
        where = f"rank(s) {sorted(err.failures)}"
        err = cause
    else:
        where = f"rank {_rank()}"
    return CheckpointError(
        f"{operation} failed on {where}: {type(err).__name__}: {_first_line(err)} (for a load: "
        "a shard file may be corrupted; for a save: check the disk and that every rank can write)"
    )


@contextlib.contextmanager
def _dcp_call(operation: str, no_dist: bool) -> Iterator[None]:
    """Translate DCP's errors; silence its 'single process' warning when that is the intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        try:
            yield
        except (Exception, CheckpointException) as err:
            raise _dcp_error(operation, err) from err


# -- what is saved -----------------------------------------------------------------------------


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def _state(learner: Learner) -> dict[str, Any]:
    """`learner.checkpoint()` plus this rank's RNG states, under a key only this rank writes.

    RNG states differ per rank; DCP would keep one copy of a key every rank saves, so each rank
    saves `rng.rank<r>.<device>`.
    """
    state = learner.checkpoint()
    if RNG_KEY in state:
        raise CheckpointError(f"Learner.checkpoint() returned a '{RNG_KEY}' entry; it is reserved")
    state[RNG_KEY] = {_rank_key(_rank()): _rng_states()}
    return state


def _saved_ranks(metadata: Metadata) -> set[str]:
    return {
        key.split(".")[1] for key in metadata.state_dict_metadata if key.startswith(f"{RNG_KEY}.")
    }


def _template(learner: Learner, metadata: Metadata) -> dict[str, Any]:
    """What to load into: the learner's own state (right layout, right shapes) and RNG slots.

    RNG states are restored only when the checkpoint was saved by a world of the same size:
    otherwise ranks do not correspond and the state is left as it is (with a warning).
    """
    state = learner.checkpoint()
    saved_ranks = _saved_ranks(metadata)
    if len(saved_ranks) != _world_size():
        if _rank() == 0:
            warnings.warn(
                f"RNG states not restored: the checkpoint was saved by {len(saved_ranks)} "
                f"rank(s), this world has {_world_size()}; RNG states are per rank",
                stacklevel=3,
            )
        return state
    key = _rank_key(_rank())
    slots = {
        kind: torch.empty_like(current)
        for kind, current in _rng_states().items()
        if f"{RNG_KEY}.{key}.{kind}" in metadata.state_dict_metadata
    }
    if slots:
        state[RNG_KEY] = {key: slots}
    return state


def _restore_rng(rng: dict[str, dict[str, torch.Tensor]] | None) -> None:
    for states in (rng or {}).values():
        if "cpu" in states:
            torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])


# -- save ----------------------------------------------------------------------------------------

_PENDING: SaveHandle | None = None


class SaveHandle:
    """A save in flight (asynchronous) or done (synchronous): `wait()` returns the committed path.

    `wait()` is a collective: every rank calls it. It returns once rank 0 has renamed the step
    directory and moved `latest`, and raises on every rank if the save failed on any.
    """

    def __init__(
        self,
        path: Path,
        operation: str,
        group: dist.ProcessGroup | None = None,
        future: Future | None = None,
    ) -> None:
        self.path = path
        self._operation = operation
        self._group = group
        self._future = future
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether this rank's part (on rank 0: the commit too) has finished; never blocks."""
        return self._future is None or self._future.done()

    def wait(self) -> Path:
        global _PENDING
        if self._future is not None:
            future, self._future = self._future, None
            if _PENDING is self:
                _PENDING = None
            error = None
            try:
                future.result()
            except (Exception, CheckpointException) as err:
                error = _dcp_error(self._operation, err)
            try:
                _agree(self._group, self._operation, error)
            except CheckpointError as err:
                self._error = err
        if self._error is not None:
            raise self._error
        return self.path


def wait_for_pending_save() -> None:
    """Finish the asynchronous save still in flight, if any (a collective, like `wait()`).

    Called by `save` and `load` first: DCP's collectives of two saves must not interleave on
    the checkpoint group.
    """
    if _PENDING is not None:
        _PENDING.wait()


def _then_commit(upload: Future, commit: Callable[[], Path]) -> Future:
    """A future that completes after `upload` and then `commit` (rank 0's async save)."""
    done: Future = Future()

    def on_upload(future: Future) -> None:
        try:
            future.result()
            done.set_result(commit())
        except BaseException as err:  # CheckpointException is a BaseException
            done.set_exception(err)

    upload.add_done_callback(on_upload)
    return done


class _AlreadyStaged:
    """An AsyncStager that stages nothing: `Learner.checkpoint()` already returned CPU clones."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _on_cpu(state: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    def tensors(value: Any) -> Iterator[torch.Tensor]:
        if isinstance(value, dict):
            for item in value.values():
                yield from tensors(item)
        elif isinstance(value, torch.Tensor):
            yield value.to_local() if isinstance(value, DTensor) else value

    return all(t.device.type == "cpu" for t in tensors(state))


def _check_options(keep_latest_k: int, timeout: float) -> None:
    if not isinstance(keep_latest_k, int) or keep_latest_k < 0:
        raise ValueError(f"keep_latest_k must be an int >= 0 (0 keeps all), got {keep_latest_k!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


def save(
    learner: Learner,
    directory: str | os.PathLike,
    *,
    keep_latest_k: int = 0,
    asynchronous: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
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
    """
    _check_options(keep_latest_k, timeout)
    wait_for_pending_save()
    root, step = Path(directory), int(learner.step)
    operation = f"checkpoint save of step {step} to {root}"
    group = _checkpoint_group(timeout)
    _join(group, timeout, operation)
    _on_rank0(group, operation, lambda: _prepare(root, step))
    state = _state(learner)
    writer = FileSystemWriter(_tmp_dir(root, step))
    no_dist = group is None
    commit = lambda: _commit(root, step, keep_latest_k)  # noqa: E731
    if not asynchronous:
        with _dcp_call(operation, no_dist):
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
        _on_rank0(group, operation, commit)
        return SaveHandle(_step_dir(root, step), operation)
    with _dcp_call(operation, no_dist):
        upload = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=group,
            async_stager=_AlreadyStaged() if _on_cpu(state) else None,
            no_dist=no_dist,
        )
    future = _then_commit(upload, commit) if _rank() == 0 else upload
    handle = SaveHandle(_step_dir(root, step), operation, group, future)
    global _PENDING
    _PENDING = handle
    return handle


# -- load ----------------------------------------------------------------------------------------


def load(
    learner: Learner,
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Restore `learner` from the checkpoint `latest` names (or `step`) in `directory`.

    A collective. Works across layouts and into a one-process learner: each rank reads the
    pieces of every saved shard that overlap its own. Before reading any tensor, the
    checkpoint's metadata is checked against this learner: missing, mismatched or extra keys
    raise CheckpointError listing them. Returns the step directory loaded.
    """
    _check_options(0, timeout)
    wait_for_pending_save()
    root = Path(directory)
    operation = f"checkpoint load from {root}"
    group = _checkpoint_group(timeout)
    _join(group, timeout, operation)
    path, metadata = _everywhere(group, operation, lambda: _open(root, step))
    operation = f"checkpoint load of {path}"
    state = _template(learner, metadata)
    _everywhere(group, operation, lambda: _check_fits(path, state, metadata))
    with _dcp_call(operation, group is None):
        dcp.load(
            state,
            storage_reader=_SafeReader(path, metadata),
            planner=_SafeLoadPlanner(),
            process_group=group,
            no_dist=group is None,
        )
    rng = state.pop(RNG_KEY, None)
    learner.load_checkpoint(state)
    _restore_rng(rng)
    return path
