"""Checksums of every saved record, written before the commit and verified on load.

DCP stores each record (a tensor shard or a plain value) as a byte range of a shard file. Each
rank hashes its records (xxh3-64, as weight exports do) from the bytes it writes
(checkpoint.records); rank 0 writes every rank's digests and the hash of the `.metadata` file
into `checksums.json` in the step directory, before the directory is renamed into place: a
committed step always has them. A load hashes every record it needs and compares, on every
rank, before any rank copies a byte into its state (checkpoint.safe_read), so one flipped bit
in a weight or an optimizer moment is caught and named (step, file, key) and nothing is loaded.

Cost: no file is read again to hash it. A save hashes the bytes it holds in memory (4-5 ms for
the 88 MB of a 7 M-parameter state, 0.06 x the save); a load hashes the mapped records before
it copies any (~4 ms there: a verified load took 1.1-1.2 x an unverified one, which is 4x
faster than it was). benchmarks/bench_checkpoint.py measures both; docs/performance.md has the
numbers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import xxhash
from torch.distributed.checkpoint.metadata import Metadata

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.layout import METADATA
from titan_learner.files import atomic_write_text

CHECKSUMS = "checksums.json"
ALGORITHM = "xxh3_64"
_CHUNK = 16 * 1024**2


def record_key(offset: int) -> str:
    return str(int(offset))


def _hash_range(file, offset: int, length: int) -> str:
    digest = xxhash.xxh3_64()
    file.seek(offset)
    remaining = length
    while remaining > 0:
        chunk = file.read(min(_CHUNK, remaining))
        if not chunk:
            break
        digest.update(chunk)
        remaining -= len(chunk)
    return digest.hexdigest()


def hash_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def hash_records(step_dir: Path, metadata: Metadata) -> dict[str, dict[str, str]]:
    """Every record of `metadata` hashed again from its file (what the writer hashed in memory)."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    records: dict[str, dict[str, str]] = {}
    for name, ranges in sorted(by_file.items()):
        with open(step_dir / name, "rb") as file:
            records[name] = {record_key(o): _hash_range(file, o, n) for o, n in sorted(ranges)}
    return records


def write_checksums(step_dir: Path, records: dict[str, dict[str, str]]) -> None:
    """`records` (file -> record offset -> digest) and the hash of the metadata file, into
    `step_dir/checksums.json`."""
    text = json.dumps(
        {
            "algorithm": ALGORITHM,
            "metadata": hash_bytes((step_dir / METADATA).read_bytes()),
            "records": records,
        }
    )
    atomic_write_text(step_dir / CHECKSUMS, text)


class Checksums:
    """The checksums of one step directory, to verify records as they are read."""

    def __init__(self, step_dir: Path, metadata: Metadata) -> None:
        self.step_dir = step_dir
        path = step_dir / CHECKSUMS
        try:
            data = json.loads(path.read_text())
            self.records: dict[str, dict[str, str]] = data["records"]
            self.metadata_hash: str = data["metadata"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{path} is unreadable ({err}); the step cannot be verified"
            ) from None
        self._keys = {
            (info.relative_path, record_key(info.offset)): index.fqn
            for index, info in metadata.storage_data.items()
        }

    def verify_metadata(self) -> None:
        found = hash_bytes((self.step_dir / METADATA).read_bytes())
        if found != self.metadata_hash:
            raise CheckpointError(
                f"checkpoint {self.step_dir}: {METADATA} does not match its checksum "
                f"({ALGORITHM} {found}, saved {self.metadata_hash}): it changed after the save"
            )

    def verify(self, relative_path: str, offset: int, data: bytes | memoryview) -> None:
        expected = self.records.get(relative_path, {}).get(record_key(offset))
        key = self._keys.get((relative_path, record_key(offset)), "?")
        if expected is None:
            raise CheckpointError(
                f"checkpoint {self.step_dir}: no checksum for record '{key}' in {relative_path}"
            )
        found = hash_bytes(data)
        if found != expected:
            raise CheckpointError(
                f"checkpoint {self.step_dir}: record '{key}' in {relative_path} is corrupted "
                f"({ALGORITHM} {found}, saved {expected}); nothing was loaded from this step, "
                "load another one"
            )


def load_checksums(step_dir: Path, metadata: Metadata) -> Checksums | None:
    """The step's checksums, metadata verified; None (with a warning) for a step saved before
    checksums existed, which then loads unverified."""
    if not (step_dir / CHECKSUMS).exists():
        warnings.warn(
            f"checkpoint {step_dir} has no {CHECKSUMS} (saved by an older titan_learner): its "
            "records are loaded without verification",
            stacklevel=3,
        )
        return None
    checksums = Checksums(step_dir, metadata)
    checksums.verify_metadata()
    return checksums
