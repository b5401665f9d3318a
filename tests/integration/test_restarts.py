"""A run killed without warning (SIGKILL: the OOM killer, a lost node, a scheduler without a
grace period) continues with the command that started it, `--resume auto`, and ends exactly
where an uninterrupted run ends: the same metrics rows, one per step, and the same saved state.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.restarts import (
    committed_step,
    job,
    kill_when,
    lock_holder,
    records,
    repeatable,
    saved_state,
    tensorboard_points,
    toy_job,
    train,
    training_rows,
)
from titan_learner.job.run_directory import LOCK

pytestmark = pytest.mark.slow

STEPS = 16


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run, started by `--resume auto` in an empty directory."""
    output_dir = tmp_path_factory.mktemp("whole") / "run"
    done = train(*toy_job(output_dir, STEPS, 4), "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert f"no checkpoint in {output_dir / 'checkpoints'}: starting from step 0" in done.stdout
    return output_dir


def assert_continues_exactly(cut: Path, whole: Path) -> None:
    assert [row["step"] for row in training_rows(cut)] == list(range(1, STEPS + 1))
    assert repeatable(cut) == repeatable(whole)
    assert records(cut / "samples.jsonl") == records(whole / "samples.jsonl")
    assert saved_state(cut, STEPS) == saved_state(whole, STEPS)
    assert not (cut / LOCK).exists()
    # TensorBoard too: the killed run's points after the restart's start are purged
    tag = "training/reward_mean"
    want = [(row["step"], pytest.approx(row[tag])) for row in training_rows(whole)]
    assert tensorboard_points(cut, tag) == want


def test_killed_after_a_checkpoint_the_same_command_resumes_exactly(whole, tmp_path):
    cut = tmp_path / "run"
    command = [*toy_job(cut, STEPS, 4), "--resume", "auto"]
    killed = kill_when(job(*command), lambda: committed_step(cut) >= 4, lambda: lock_holder(cut))
    assert killed.returncode == -9
    assert 4 <= committed_step(cut) < STEPS and len(training_rows(cut)) < STEPS
    assert (cut / LOCK).exists(), "SIGKILL leaves the lock behind"
    resumed_from = committed_step(cut)

    again = train(*command)
    assert again.returncode == 0, again.stderr
    assert (
        f"taking over the lock of pid {killed.pid} on {socket.gethostname()} (no longer running)"
        in again.stdout
    )
    assert f"resumed from {cut / 'checkpoints' / f'step-{resumed_from}'}" in again.stdout
    assert_continues_exactly(cut, whole)


def test_killed_before_its_first_checkpoint_the_same_command_starts_over(whole, tmp_path):
    cut = tmp_path / "run"
    command = [*toy_job(cut, STEPS, 8), "--resume", "auto"]
    killed = kill_when(
        job(*command), lambda: len(training_rows(cut)) >= 1, lambda: lock_holder(cut)
    )
    assert killed.returncode == -9
    assert committed_step(cut) == 0 and training_rows(cut), "killed after a step, before a save"

    again = train(*command)
    assert again.returncode == 0, again.stderr
    assert "taking over the lock of pid" in again.stdout
    assert_continues_exactly(cut, whole)


def test_a_finished_run_is_not_run_again(whole):
    before = (whole / "metrics.jsonl").read_text()
    again = train(*toy_job(whole, STEPS, 4), "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert (
        again.stdout
        == f"{whole} already finished its {STEPS} steps ([run] steps = {STEPS}); nothing to do\n"
    )
    assert (whole / "metrics.jsonl").read_text() == before
