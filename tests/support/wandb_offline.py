"""What an offline W&B run wrote: the records of its `run-<id>.wandb` file, read back.

wandb 0.31 ships no reader of its own (its datastore moved into the Go core), so this reads the
file's format directly: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of chunks,
each a 7-byte header (CRC32C, length, type: full, first, middle, last) and its bytes; a record is
one protobuf `Record`, whole in a full chunk or split over first..last ones.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE_HEADER = 7
CHUNK_HEADER = 7
BLOCK = 32 * 1024
FULL, LAST = 1, 4


def records(path: Path) -> Iterator[Any]:
    """Every `wandb_internal_pb2.Record` of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = FILE_HEADER, b""
    while position + CHUNK_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header: padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        start = position + CHUNK_HEADER
        pending += data[start : start + length]
        position = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def run_files(output_dir: Path, timeout_s: float = 60.0) -> list[Path]:
    """The `.wandb` files of the offline runs under `<output_dir>/wandb`, oldest first, once
    each is complete: `run.finish()` returns before W&B's core has written the file (measured:
    empty right after the first finish in a process, whole 3 s later), so wait for its exit
    record."""
    files = sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout_s
    for path in files:
        while not _has_exit(path):
            assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
            time.sleep(0.2)
    return files


def _has_exit(path: Path) -> bool:
    from google.protobuf.message import DecodeError

    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except (AssertionError, DecodeError):  # no header yet, or a record half written
        return False


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows, without W&B's own `_step`, `_runtime` and `_timestamp`."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}  # fmt: skip
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_record(path: Path) -> Any:
    """The run's own record: id, project, name, tags, config."""
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: Path) -> dict[str, Any]:
    """The run's config, as logged at init."""
    return {
        item.key: json.loads(item.value_json)
        for item in run_record(path).config.update
        if item.key != "_wandb"
    }
