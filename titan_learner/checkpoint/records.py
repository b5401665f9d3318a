"""Tensor records as raw bytes, hashed as they are written.

DCP's `FileSystemWriter` wraps every tensor record in a torch.save zip archive of its own, and
`FileSystemReader` decodes each with torch.load: at 7 M parameters most of a save and a load was
that, not the bytes. `RawWriter` writes a tensor record as the shard's contiguous bytes (C
order, little-endian) instead. Nothing else is needed to read it back: its dtype and shape are DCP's own
metadata (`TensorStorageMetadata.properties.dtype`, the saved chunk's sizes).

The format is marked per record, where DCP keeps how a record's bytes were written: the
record's `transform_descriptors` in `.metadata` hold `RAW`. Records without it are torch.save
archives (every checkpoint written before raw records, and every non-tensor record, which
stays DCP's torch.save of the value); `decode_tensor` reads both. torch's own reader refuses
the unknown descriptor instead of misreading raw bytes as an archive.

The writer hashes each record (xxh3, checkpoint.integrity) from the bytes it just wrote, so no
file is read again to checksum it. Each rank's digests travel with its write results, which DCP
gathers on rank 0 before `finish`; `finish` writes `.metadata`, then `checksums.json`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.integrity import hash_bytes, record_key, write_checksums

RAW = "titan_learner.raw/1"
"""The transform descriptor of a record that holds a tensor's raw bytes."""
ALIGNMENT = 64
"""Raw records start at a multiple of this many bytes in their file (zeros between records)."""


@dataclass(frozen=True)
class HashedRecord:
    """Where a record was written and the xxh3 of its bytes, on its way to rank 0's `finish`."""

    info: _StorageInfo
    digest: str


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes in C order (a view when it is already contiguous on CPU)."""
    tensor = tensor.detach().cpu().contiguous()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _record_bytes(item: WriteItem, data: Any) -> tuple[memoryview, list[str] | None]:
    if item.type == WriteItemType.BYTE_IO:
        return data.getbuffer(), None  # DCP's torch.save of a plain value, as DCP writes it
    if sys.byteorder != "little":  # raw records are little-endian: DCP's torch.save record
        archive = io.BytesIO()
        torch.save(data.detach().cpu().clone(), archive)
        return archive.getbuffer(), None
    chunk, dtype = item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype
    if tuple(data.shape) != tuple(chunk) or data.dtype != dtype:
        raise CheckpointError(  # the reader takes shape and dtype from the metadata
            f"record '{item.index.fqn}': the tensor is {data.dtype} {tuple(data.shape)}, the "
            f"save plan says {dtype} {tuple(chunk)}"
        )
    return tensor_bytes(data), [RAW]


def _write_file(
    path: Path, name: str, items: list[WriteItem], planner: SavePlanner, sync: bool
) -> list[WriteResult]:
    results = []
    with open(path, "wb") as stream:
        for item in items:
            data, descriptors = _record_bytes(item, planner.resolve_data(item))
            if descriptors:  # a raw record starts aligned: the reader views it as its dtype
                stream.write(bytes(-stream.tell() % ALIGNMENT))
            offset = stream.tell()
            stream.write(data)
            info = _StorageInfo(name, offset, len(data), transform_descriptors=descriptors)
            digest = hash_bytes(data)  # the bytes just written, still in memory
            results.append(WriteResult(item.index, len(data), HashedRecord(info, digest)))
        stream.flush()
        if sync:
            os.fsync(stream.fileno())
    return results


class RawWriter(FileSystemWriter):
    """DCP's file writer with raw tensor records, each hashed as it is written.

    One file per rank (DCP's default), written by the calling thread. `finish` (rank 0, after
    DCP gathered every rank's write results) writes `.metadata` and then `checksums.json`.
    """

    def _write_data(self, planner: SavePlanner, file_queue: Any) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        while not file_queue.empty():
            path, name, items = file_queue.get_nowait()
            results.extend(_write_file(Path(path), name, items, planner, self.sync_files))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, dict[str, str]] = {}
        written = []
        for result in (result for rank_results in results for result in rank_results):
            record: HashedRecord = result.storage_data
            digests.setdefault(record.info.relative_path, {})[record_key(record.info.offset)] = (
                record.digest
            )
            written.append(dataclasses.replace(result, storage_data=record.info))
        super().finish(metadata, [written])
        write_checksums(Path(self.path), digests)


def _chunk_size(entry: TensorStorageMetadata, index: MetadataIndex) -> torch.Size:
    for chunk in entry.chunks:
        if chunk.offsets == index.offset:
            return chunk.sizes
    raise CheckpointError(f"record '{index.fqn}' at {list(index.offset or ())} is not in .metadata")


def decode_tensor(
    data: torch.Tensor, info: _StorageInfo, index: MetadataIndex, metadata: Metadata
) -> torch.Tensor:
    """A tensor record's chunk from its bytes (`data`, uint8): raw (a view) or torch.save."""
    descriptors = list(info.transform_descriptors or ())
    if not descriptors:
        return torch.load(io.BytesIO(data.numpy()), map_location="cpu", weights_only=True)
    if descriptors != [RAW]:
        raise CheckpointError(
            f"record '{index.fqn}' in {info.relative_path} was written with {descriptors}; "
            f"allowed: torch.save records or {RAW}"
        )
    entry = metadata.state_dict_metadata[index.fqn]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"record '{index.fqn}' is raw but not a tensor in .metadata")
    dtype, shape = entry.properties.dtype, _chunk_size(entry, index)
    expected = shape.numel() * dtype.itemsize
    if data.numel() != expected:
        raise CheckpointError(
            f"record '{index.fqn}' in {info.relative_path} has {data.numel()} bytes; "
            f"{dtype} {tuple(shape)} needs {expected}"
        )
    if sys.byteorder != "little":
        raise CheckpointError(
            f"record '{index.fqn}': raw records are little-endian, this machine is not"
        )
    if data.storage_offset() % dtype.itemsize:  # not written by RawWriter: align a copy
        data = data.clone()
    return data.view(dtype).view(shape)
