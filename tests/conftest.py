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


@pytest.fixture(autouse=True, scope="module")
def _no_launcher_environment_for_module_fixtures():
    """The same for a module's own fixtures, which run before any test's: a job run in this
    process (a reference model, a one-process learner) sets these variables for good, and a
    module fixture's subprocess would then join that process's world (seen in CI: a run in
    test_restarts' fixture failed with EADDRINUSE on the port this process held)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in LAUNCHER_VARIABLES:
            patch.delenv(name, raising=False)
        yield
