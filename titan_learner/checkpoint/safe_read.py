"""Reading a DCP checkpoint without running pickled code, and naming what is damaged.

DCP alone does not guarantee this in torch 2.13:
- `FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`: no weights_only,
  no safe-globals list. We read it with a restricted unpickler that resolves only DCP's own
  metadata types (the same file format, not a new one).
- `DefaultLoadPlanner.load_bytes` reads non-tensor entries with `torch.load(weights_only=False)`.
  We load them with `weights_only=True` (our non-tensor entries are plain ints, floats, lists).
- Tensor records are raw bytes (checkpoint.records), or, in checkpoints written before those,
  torch.save archives read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from titan_learner.checkpoint.agreement import same_error
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.integrity import Checksums, load_checksums
from titan_learner.checkpoint.layout import METADATA, resolve
from titan_learner.checkpoint.records import decode_tensor

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


_ZIP_MAGIC = b"PK\x03\x04"
"""How every torch.save archive starts (DCP's records of plain values are torch.save's)."""


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_CANNOT_MAP = (errno.EINVAL, errno.ENODEV, errno.EOPNOTSUPP)  # an old kernel, a file system


def _read_ranges(file: Any, size: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    data = torch.empty(size, dtype=torch.uint8)  # pages outside `ranges` are never touched
    view = memoryview(data.numpy())
    for offset, length in ranges:
        file.seek(offset)
        if file.readinto(view[offset : offset + length]) != length:
            raise OSError(f"{Path(file.name).name} ends inside a record at byte {offset}")
    return data


def _map_ranges(file: Any, size: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    mapping = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
    for offset, length in ranges:
        start = offset - offset % mmap.PAGESIZE
        if length:
            mapping.madvise(_MADV_POPULATE_READ, start, offset + length - start)
    with warnings.catch_warnings():  # it is only read: copied from, hashed, unpickled
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


def _file_bytes(path: Path, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The bytes of a shard file as one uint8 tensor, of which `ranges` (offset, length) are
    readable: a read-only mapping of the file on Linux, so records are hashed and copied
    straight from the page cache, never first into a buffer of their own.

    MADV_POPULATE_READ reads the ranges in up front, so a disk error or a file shorter than
    its records is an OSError here, not a SIGBUS later. Where that or the mapping is not
    available (not Linux, a kernel before 5.14), the ranges are read into memory.
    """
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        if sys.platform == "linux":
            try:
                return _map_ranges(file, size, ranges)
            except OSError as err:
                if err.errno not in _CANNOT_MAP:
                    raise
        return _read_ranges(file, size, ranges)


class SafeReader(FileSystemReader):
    """DCP's file reader, handed the metadata we already read safely (not `pickle.load`).

    It verifies every record this rank needs against the step's checksums
    (checkpoint.integrity) and decodes it (checkpoint.records: raw or torch.save) before it
    copies anything into the state being loaded: a damaged record, named with its file, is
    found before any tensor changes. A raw record is hashed and copied in place, from the
    mapped file (`_file_bytes`).
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        checksums: Checksums | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._checksums = checksums
        self._group = group
        self._reading = "?"

    def _read_records(self, plan: LoadPlan, planner: LoadPlanner) -> dict[Any, torch.Tensor]:
        """Every record this rank needs, verified; tensors decoded, plain values loaded."""
        per_file: dict[str, dict[Any, list[ReadItem]]] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, {}).setdefault(item.storage_index, []).append(item)
        tensors: dict[Any, torch.Tensor] = {}
        for relative_path, records in per_file.items():
            self._reading = relative_path
            infos = {index: self.storage_data[index] for index in records}
            ranges = sorted((info.offset, info.length) for info in infos.values())
            whole = _file_bytes(Path(self.path) / relative_path, ranges)
            for index, items in records.items():
                info = infos[index]
                data = whole[info.offset : info.offset + info.length]
                if self._checksums is not None:
                    self._checksums.verify(relative_path, info.offset, memoryview(data.numpy()))
                if items[0].type == LoadItemType.BYTE_IO:
                    if bytes(data[:4].numpy()) != _ZIP_MAGIC:  # garbage, not a refusal
                        raise ValueError(f"record '{index.fqn}' is not a torch.save archive")
                    for item in items:
                        planner.load_bytes(item, io.BytesIO(data.numpy()))
                else:
                    tensors[index] = decode_tensor(data, info, index, self._metadata)
        return tensors

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        error, tensors = None, {}
        try:
            tensors = self._read_records(plan, planner)
        except CheckpointError as err:
            error = err
        except Exception as err:
            error = CheckpointError(
                f"shard file {Path(self.path) / self._reading} is corrupted: a record in it "
                f"could not be read ({type(err).__name__}: {_unpickling_reason(err)})"
            )
        # No rank copies a byte into its state unless every rank's records are sound.
        same_error(self._group, error)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            source = narrow_tensor_by_index(
                tensors[item.storage_index], item.storage_offsets, item.lengths
            )
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CheckpointError(
                    f"record '{item.storage_index.fqn}': {tuple(source.size())} read for a "
                    f"destination of {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

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
