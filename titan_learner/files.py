"""Writing files so that a reader (or a crash) never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable, not just visible."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace `path` with `text`: a reader sees the old file or the new one, whole.

    Temp file beside it (`.<name>.<pid>.tmp`), fsync, `os.replace`, then fsync of the
    directory so the rename survives a power loss; the temp file never outlives a failure.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}{TMP_SUFFIX}"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path
