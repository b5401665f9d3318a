"""An engine core whose parent is SIGKILLed exits (titan_learner.vllm.orphan_guard), in real
processes: a parent that starts a child the way vLLM starts its engine core (multiprocessing,
fork or spawn, named EngineCore), then dies. A child by any other name is left alone. The
same guard inside a real vLLM server: tests/integration/test_rollout_servers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import running

PARENT = """
import multiprocessing, sys, time
from titan_learner.vllm.orphan_guard import exit_with_parent

def engine():
    exit_with_parent()
    time.sleep(600)

if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    child = context.Process(target=engine, name=sys.argv[2], daemon=False)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


def orphan(tmp_path: Path, method: str, name: str) -> int:
    """The child's pid, once its parent has been SIGKILLed."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), method, name],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    child = int(parent.stdout.readline())
    time.sleep(1.5)  # the child is running its watch (or not)
    parent.kill()
    parent.wait()
    return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_engine_core_exits_once_its_parent_is_killed(tmp_path, method):
    child = orphan(tmp_path, method, "EngineCore")
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not running(child), f"the orphaned engine core {child} still runs"
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_that_is_no_engine_core_is_left_alone(tmp_path):
    child = orphan(tmp_path, "spawn", "Worker")
    try:
        time.sleep(3)  # three of the watch's polls
        assert running(child)
    finally:
        os.kill(child, signal.SIGKILL)
