"""A trainer's held engine (titan_learner.vllm.parent_signals), in real processes: a child
started the way vLLM starts its engine core (multiprocessing, named EngineCore, its own SIGTERM
handler installed before our plugin loads) ignores a SIGTERM from anyone while its trainer
holds it, and takes its trainer's own stop once the hold is released; started without a hold
(a server's engine), it takes any SIGTERM as before. The whole job under such signals:
tests/integration/test_vllm_job.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import running

REPO = Path(__file__).resolve().parents[2]
TRAINER = """
import contextlib, multiprocessing, signal, sys, time
from titan_learner.vllm.parent_signals import hold_engine, take_signals_from_parent

def engine():
    def stop(signum, frame):  # vLLM's engine core handler: it begins the engine's shutdown
        print("engine stopped", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    take_signals_from_parent()  # the plugin, loaded as the engine core builds
    time.sleep(600)

if __name__ == "__main__":
    hold = hold_engine() if sys.argv[1] == "held" else contextlib.nullcontext()
    with hold as held:
        child = multiprocessing.get_context("spawn").Process(target=engine, name="EngineCore")
        child.start()
    print(child.pid, held.path if held else "", flush=True)
    sys.stdin.readline()  # the test has signalled the engine from outside
    if held is not None:
        held.release()
    child.terminate()  # vLLM's shutdown of its engine core
    child.join(30)
    print("exit code", child.exitcode, flush=True)
"""


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int, str]:
    """The trainer, its engine's pid and the hold's path ("" unheld)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    engine, hold = trainer.stdout.readline().rstrip("\n").split(" ", 1)
    time.sleep(2.0)  # the engine has installed its handlers
    return trainer, int(engine), hold


def test_a_held_engine_ignores_a_sigterm_from_outside_and_stops_when_its_trainer_stops_it(
    tmp_path,
):
    trainer, engine, _ = start(tmp_path, "held")
    subprocess.run(["kill", "-TERM", str(engine)], check=True)  # Slurm's, to every process
    time.sleep(1.0)
    out, _ = trainer.communicate("go\n", timeout=60)
    before, after = out.split("engine stopped", 1) if "engine stopped" in out else (out, "")
    assert "SIGTERM ignored: this engine stops when its trainer stops it" in before
    assert after.strip().endswith("exit code 0"), out


def test_an_engine_nobody_holds_stops_on_any_sigterm(tmp_path):
    trainer, engine, _ = start(tmp_path, "free")
    subprocess.run(["kill", "-TERM", str(engine)], check=True)
    time.sleep(1.0)
    out, _ = trainer.communicate("go\n", timeout=60)
    assert "ignored" not in out and out.count("engine stopped") == 1, out
    assert out.strip().endswith("exit code 0"), out


def test_an_engine_killed_outright_leaves_no_hold_file_behind(tmp_path):
    trainer, engine, hold = start(tmp_path, "held")
    own = Path(f"{hold}.{engine}")  # the engine core's hold on its workers
    assert Path(hold).exists() and own.exists()
    os.kill(engine, signal.SIGKILL)  # the OOM killer, or vLLM's kill of a slow shutdown
    out, _ = trainer.communicate("go\n", timeout=60)
    assert out.strip().endswith(f"exit code {-signal.SIGKILL}"), out
    assert not own.exists() and not Path(hold).exists()


def test_a_trainer_killed_outright_leaves_no_hold_file_behind(tmp_path):
    trainer, engine, hold = start(tmp_path, "held")
    trainer.kill()  # the OOM killer: the trainer's release never runs
    trainer.wait(30)
    os.kill(engine, signal.SIGTERM)  # the orphan guard's, once the engine sees its parent gone
    deadline = time.monotonic() + 30
    while running(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(engine)
    assert not Path(hold).exists() and not Path(f"{hold}.{engine}").exists()


def test_a_hold_lives_from_before_the_engine_starts_until_its_release():
    from titan_learner.vllm.parent_signals import HOLD_ENV, hold_engine

    with hold_engine() as hold:
        assert os.environ[HOLD_ENV] == str(hold.path) and hold.path.exists()
    assert HOLD_ENV not in os.environ and hold.path.exists()
    hold.release()
    hold.release()  # idempotent: close, then exit
    assert not hold.path.exists()
    with pytest.raises(RuntimeError), hold_engine() as failed:
        raise RuntimeError("the engine did not start")
    assert not failed.path.exists() and HOLD_ENV not in os.environ
