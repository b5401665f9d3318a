"""Reading a DCP checkpoint without running pickled code, and naming what is damaged.

DCP alone does not guarantee this in torch 2.13:
- `FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`: no weights_only,
  no safe-globals list. We read it with a restricted unpickler that resolves only DCP's own
  metadata types (the same file format, not a new one).
- `DefaultLoadPlanner.load_bytes` reads non-tensor entries with `torch.load(weights_only=False)`.
  We load them with `weights_only=True` (our non-tensor entries are plain ints, floats, lists).
- Tensor payloads are read with `torch.load(weights_only=True)` by DCP itself.
"""

from __future__ import annotations

import io
import os
import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.integrity import Checksums, load_checksums
from titan_learner.checkpoint.layout import METADATA, resolve

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


class SafeReader(FileSystemReader):
    """DCP's file reader, handed the metadata we already read safely (not `pickle.load`).

    It also remembers which shard file it is reading, so a corrupted one is named, and
    verifies each record against the step's checksums (checkpoint.integrity) as it reads it.
    """

    def __init__(self, path: Path, metadata: Metadata, checksums: Checksums | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._checksums = checksums
        self._reading = "?"

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        """The record's bytes, verified against the checksum saved with them."""
        self._reading = sinfo.relative_path
        view = super()._slice_file(file, sinfo)
        if self._checksums is None:
            return view
        data = view.read()
        self._checksums.verify(sinfo.relative_path, sinfo.offset, data)
        return io.BytesIO(data)  # read once: torch.load decodes the bytes that were verified

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


class SafeLoadPlanner(DefaultLoadPlanner):
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


def check_shard_files(path: Path, metadata: Metadata) -> None:
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


def open_step(root: Path, step: int | None) -> tuple[Path, Metadata, Checksums | None]:
    """The step directory to load, its metadata and checksums, every file checked present."""
    path = resolve(root, step)
    metadata = read_metadata(path)
    check_shard_files(path, metadata)
    return path, metadata, load_checksums(path, metadata)
