"""A checkpoint save that meets a really full disk: a small tmpfs, mounted for the test (root on
Linux; skipped, saying why, where mounting is not allowed). The kernel's own ENOSPC, not a
simulated one: the error names it and the path, the partial step-N.tmp is removed at once (the
space is free again), and the previous checkpoint stays `latest` and loads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.models import batches, tiny_config
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.layout import latest
from titan_learner.checkpoint.save_load import load, save
from titan_learner.learner.local import LocalLearner

HEADROOM = 64 * 1024  # what is left free after the first checkpoint: less than a second one


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path) -> None:
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as out:
        out.truncate(0)
        out.write(b"\0" * max(free - HEADROOM, 0))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_keeps_the_last_checkpoint_and_frees_the_partial_one(small_disk, asynchronous):
    root = small_disk / "checkpoints"
    learner = LocalLearner(tiny_config())
    learner.update(batches(1)[0])
    first = save(learner, root).wait()
    fill(small_disk)
    learner.update(batches(2)[1])
    with pytest.raises(CheckpointError) as info:
        save(learner, root, asynchronous=asynchronous).wait()
    message = str(info.value)
    assert "No space left on device" in message and str(root) in message, message
    assert latest(root) == first
    assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
    assert shutil.disk_usage(small_disk).free >= HEADROOM // 2, "the partial write was freed"
    resumed = LocalLearner(tiny_config())
    assert load(resumed, root) == first and resumed.step == 1
