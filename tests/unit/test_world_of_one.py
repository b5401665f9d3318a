"""A world of one that a process forms without a launcher must not leak into what runs after it.

The sequence CI met: a job run in the pytest process forms a world of one and leaves RANK,
WORLD_SIZE and MASTER_PORT set; then a later run in that process, a plain child process it
starts, and the workers of a spawned gloo world (which inherit the environment and rewrite the
launcher variables) each have to form the world their variables describe.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as dist

from tests.support.worlds import run_world
from titan_learner.model import platform
from titan_learner.model.parallelize import init_process_group

CHILD = (
    "import torch.distributed as dist\n"
    "from titan_learner.model.parallelize import init_process_group\n"
    "init_process_group('cpu')\n"
    "print(dist.get_rank(), dist.get_world_size())\n"
    "dist.destroy_process_group()\n"
)


def _world_size(rank: int) -> tuple[int, int]:
    init_process_group("cpu")
    return dist.get_rank(), dist.get_world_size()


def _form_world_of_one() -> None:
    init_process_group("cpu")
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    dist.destroy_process_group()


def test_what_runs_after_a_world_of_one_forms_the_world_its_variables_describe():
    _form_world_of_one()
    gone_port = os.environ["MASTER_PORT"]
    # A second run in this process: a new store, not the gone one's port.
    _form_world_of_one()
    assert os.environ["MASTER_PORT"] != gone_port
    # A plain child inherits the variables as they are: it forms a world of one of its own.
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["0", "1"]
    # Spawned workers inherit the marker but rewrite the variables: they join their world of 2.
    assert run_world(2, _world_size, timeout=120) == [(0, 2), (1, 2)]


def test_a_launcher_world_is_joined_even_with_the_marker_values():
    """Under torchrun (TORCHELASTIC_RUN_ID set) the variables are the launcher's, always."""
    _form_world_of_one()
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    try:
        assert platform.default_single_process_env() is False
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
