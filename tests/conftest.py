"""Fixtures every test gets.

The helpers tests share (tiny configs, synthetic batches, gloo worlds, the scenarios run inside
them) live in `tests.support` and are imported by package path: the spawned processes of a
world import them the same way.
"""

from __future__ import annotations

import pytest

# What torchrun sets: a test that inherits them would join (or form) the wrong process group,
# and `check` would default --world-size to the launcher's. Worlds set their own per process.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
