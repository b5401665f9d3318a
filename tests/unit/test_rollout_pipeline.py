"""The rollout pipeline: which weights each step's rollout is sampled from, decided by the
schedule and never by timing; a thread that fails ends the run with its error."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from titan_learner.rollout.pipeline import (
    GeneratorFailed,
    RolloutPipeline,
    rollout_version,
    stale_versions_after,
)


def every(n: int):
    return lambda step: step % n == 0


def test_versions_lag_k_and_drain_after_sync_points():
    versions = [rollout_version(t, 1, 0, every(3)) for t in range(1, 9)]
    assert versions == [0, 0, 1, 3, 3, 4, 6, 6]
    stale = [t - 1 - v for t, v in zip(range(1, 9), versions, strict=True)]
    assert stale == [0, 1, 1, 0, 1, 1, 0, 1] and max(stale) <= 1
    assert [rollout_version(t, 2, 0, every(100)) for t in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    # a resumed run starts from its step: the first rollout is on-policy
    assert [rollout_version(t, 1, 5, every(100)) for t in range(6, 9)] == [5, 5, 6]


def test_the_versions_kept_for_stale_steps_are_those_they_are_sampled_from():
    """Before the update of `step` (the learner holds step - 1): which versions coming stale
    steps need, so that their log-prob mismatch is measured under the sampling weights."""
    never, third = every(100), every(3)
    # k=1: step t+1 is sampled from t-1, the version the learner holds now
    assert [stale_versions_after(t, 1, 0, never, 10) for t in (1, 2, 5)] == [{0}, {1}, {4}]
    # k=2: steps t+1 and t+2 need t-2 and t-1 (one kept before, one now); none past the end
    assert stale_versions_after(5, 2, 0, never, 10) == {3, 4}
    assert stale_versions_after(9, 2, 0, never, 10) == {7}
    assert stale_versions_after(10, 2, 0, never, 10) == set()
    # after sync point 3 the next step is on-policy; the one after trains on version 3
    assert [stale_versions_after(t, 1, 0, third, 10) for t in (3, 4)] == [set(), {3}]


class FakeGenerator:
    """Records which weights each rollout saw; sleeps like a generator would."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.version = 0
        self.fail_at = fail_at
        self.loads: list[int] = []

    def load_weights(self, named, version: int) -> None:
        assert named[0][1].item() == version, "the weights of another version were handed over"
        self.version = version
        self.loads.append(version)

    def produce(self, step: int) -> int:
        time.sleep(0.01)
        if step == self.fail_at:
            raise OSError("engine process died")
        return self.version


def run_steps(pipeline: RolloutPipeline, steps: range, is_sync, update_s: float = 0.0):
    """The learner's side: take, 'train', publish (or load directly at sync points)."""
    seen = []
    for step in steps:
        produced = pipeline.take(step)
        seen.append((step, produced.version, produced.value))
        time.sleep(update_s)
        if is_sync(step):
            pipeline.parked()
            pipeline._load([("w", torch.tensor(float(step)))], step)  # the caller loads itself
            pipeline.mark_loaded(step)
        else:
            pipeline.publish(step, [("w", torch.tensor(float(step)))])
    return seen


@pytest.mark.parametrize("update_s", [0.0, 0.03])  # a learner faster and slower than sampling
def test_each_rollout_is_sampled_from_its_scheduled_version(update_s):
    generator = FakeGenerator()
    sync = every(4)
    pipeline = RolloutPipeline(
        generator.produce,
        generator.load_weights,
        off_policy_steps=1,
        is_sync_point=sync,
        start=0,
        last_step=9,
    )
    try:
        seen = run_steps(pipeline, range(1, 10), sync, update_s)
    finally:
        pipeline.close()
    for step, version, sampled_with in seen:
        assert version == rollout_version(step, 1, 0, sync) == sampled_with, step
    assert threading.active_count() >= 1 and not pipeline._thread.is_alive()


def test_a_failing_generator_ends_the_run_with_its_error_not_a_hang():
    generator = FakeGenerator(fail_at=3)
    pipeline = RolloutPipeline(
        generator.produce,
        generator.load_weights,
        off_policy_steps=1,
        is_sync_point=every(100),
        start=0,
        last_step=10,
    )
    start = time.perf_counter()
    with pytest.raises(GeneratorFailed) as err:
        run_steps(pipeline, range(1, 11), every(100))
    assert str(err.value) == (
        "the rollout generator failed in its thread: OSError: engine process died"
    )
    assert isinstance(err.value.__cause__, OSError)
    pipeline.close()
    assert time.perf_counter() - start < 10


def test_off_policy_steps_must_be_positive():
    with pytest.raises(ValueError, match="off_policy_steps must be >= 1, got 0"):
        RolloutPipeline(
            lambda step: step,
            lambda named, version: None,
            off_policy_steps=0,
            is_sync_point=every(1),
            start=0,
            last_step=1,
        )


def test_a_preempted_pipeline_resumes_with_its_queue_as_if_never_stopped():
    """k=2, stopped after step 5 (no sync point): the parked thread has sampled every step
    whose version the learner reached (6, 7, 8 from versions 3, 4, 5); a pipeline started at
    step 5 with them goes on with the versions of the uninterrupted run."""
    never = every(100)

    def pipeline_of(generator, start, queued=()):
        return RolloutPipeline(
            generator.produce,
            generator.load_weights,
            off_policy_steps=2,
            is_sync_point=never,
            start=start,
            last_step=10,
            queued=queued,
        )

    whole = pipeline_of(FakeGenerator(), 0)
    try:
        uninterrupted = run_steps(whole, range(1, 11), never)
    finally:
        whole.close()
    first = pipeline_of(FakeGenerator(), 0)
    try:
        before = run_steps(first, range(1, 6), never)
        first.parked()
        queued = first.queued()
    finally:
        first.close()
    assert [(p.step, p.version) for p in queued] == [(6, 3), (7, 4), (8, 5)]
    resumed_generator = FakeGenerator()
    resumed_generator.version = 5  # the checkpoint's weights
    resumed = pipeline_of(resumed_generator, 5, queued)
    try:
        after = run_steps(resumed, range(6, 11), never)
    finally:
        resumed.close()
    assert before + after == uninterrupted
    with pytest.raises(ValueError, match=r"queued rollouts must be of steps 6, \.\.\.; got \[7\]"):
        pipeline_of(FakeGenerator(), 5, queued[1:2])
