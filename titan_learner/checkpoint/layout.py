"""Where checkpoints live on disk, and how a step is committed atomically.

Under one checkpoint root directory:

    <root>/step-<N>/       a committed checkpoint (DCP: `.metadata` + `__<rank>_<i>.distcp`,
                           and `checksums.json`: see checkpoint.integrity)
    <root>/step-<N>.tmp/   a save in progress, or one that died mid-way: never loaded
    <root>/latest          the name of the newest committed step directory, written last

Only rank 0 changes the layout (`prepare`, `commit`); every rank reads it (`resolve`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.config.schema import Config
from titan_learner.config.toml import RESOLVED_CONFIG, resolved_config_text
from titan_learner.files import TMP_SUFFIX, atomic_write_text, fsync_dir

LATEST = "latest"
METADATA = ".metadata"
_STEP_NAME = re.compile(r"^step-(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
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


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` atomically: a reader sees the old name or the new one, whole."""
    atomic_write_text(root / LATEST, name + "\n")


def prepare(root: Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty `step-<N>.tmp`, with stale leftovers removed."""
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    current = latest(root)
    if current is not None and current.name == final.name:
        raise CheckpointError(
            f"step {step} is already the latest committed checkpoint in {root}, and a committed "
            "checkpoint cannot be replaced atomically; allowed: save at a step not saved yet, "
            f"another directory, or remove {final} (and {root / LATEST}) first"
        )
    if final.exists():  # not what `latest` names: left by a save interrupted before its pointer
        shutil.rmtree(final)
    tmp = tmp_dir(root, step)
    if tmp.exists():  # a save of this step that died before its commit
        shutil.rmtree(tmp)
    for pointer in root.glob(f".{LATEST}.*{TMP_SUFFIX}"):  # a `latest` write that was killed
        pointer.unlink(missing_ok=True)
    tmp.mkdir()
    return tmp


def commit(root: Path, step: int, keep_latest_k: int) -> Path:
    """Rank 0, once every rank's shards and the metadata are on disk: rename, then `latest`."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    if not (tmp / METADATA).is_file():
        raise CheckpointError(f"{tmp} has no {METADATA} after the save; nothing was committed")
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, final.name)
    rotate(root, keep_latest_k, step)
    return final


def rotate(root: Path, keep_latest_k: int, current: int) -> None:
    """Keep the newest `keep_latest_k` committed steps (0 keeps all); drop dead `.tmp` saves."""
    if keep_latest_k > 0:
        for step in committed_steps(root)[:-keep_latest_k]:
            if step != current:
                shutil.rmtree(step_dir(root, step), ignore_errors=True)
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
        path = step_dir(root, step)
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


def save_resolved_config(config: Config, directory: str | os.PathLike) -> Path:
    """Write the run's resolved config to `directory/config.toml` atomically (a reader sees
    the previous file or the new one, whole); return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(directory / RESOLVED_CONFIG, resolved_config_text(config))


def checkpoint_root(directory: Path) -> Path:
    """The checkpoint root of a root or a step directory (a step directory has the metadata and
    no `latest` of its own)."""
    is_step_dir = (directory / METADATA).is_file() and not (directory / LATEST).exists()
    return directory.parent if is_step_dir else directory
