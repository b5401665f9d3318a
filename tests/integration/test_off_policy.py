"""The GRPO job with `[rollout] max_off_policy_steps = 1`: rollouts sampled one version ahead
in a thread, staleness reported, a resume exact, a generator failure one clear error."""

from __future__ import annotations

import pytest

from tests.integration.test_train import short_run, training_lines
from tests.support.worlds import run_world

K1 = ["rollout.max_off_policy_steps=1", "checkpoint.interval=2", "eval.every_steps=0"]


def preempted_at(rank: int, output_dir: str, steps: int, stop_after: int) -> list[dict]:
    """A run that gets SIGTERM (on rank 0 only) while it trains step `stop_after`."""
    import signal

    from titan_learner.job import grpo

    train_on, calls = grpo.train_on, {"n": 0}

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == stop_after and rank == 0:
            signal.raise_signal(signal.SIGTERM)
        return train_on(*args, **kwargs)

    grpo.train_on = signalled
    try:
        return short_run(rank, output_dir, steps, K1)
    finally:
        grpo.train_on = train_on


def interrupted_and_whole(rank: int, root: str) -> dict[str, list[dict]]:
    return {
        "whole": short_run(rank, f"{root}/whole", 5, K1),
        # without the kept weights: the same training, no mismatch on the stale step
        "first": short_run(rank, f"{root}/cut", 2, [*K1, "rollout.stale_logprob_mismatch=false"]),
        "resumed": short_run(rank, f"{root}/cut", 5, K1, resume=True),
        # step 3 is no sync point: step 4's rollout (from version 2) is queued when it stops
        "preempted": preempted_at(rank, f"{root}/preempted", 5, stop_after=3),
        "after": short_run(rank, f"{root}/preempted", 5, K1, resume=True),
        # tensor parallel: the kept weights are TP-sharded DTensors, the lm_head a module
        "tp": short_run(rank, f"{root}/tp", 3, [*K1, "parallelism.tp=2", "parallelism.dp_shard=1"]),
    }


@pytest.mark.slow
def test_one_step_off_policy_on_two_ranks_resumes_exactly(tmp_path):
    """dp_shard=2, k=1, checkpoints every 2 steps: the pipeline drains after each, so a run
    cut at step 2 and resumed repeats the uninterrupted run step for step; so does one
    preempted at step 3, between sync points (its queued rollout is in the checkpoint). The
    stale mismatch also under tensor parallelism (tp=2)."""
    ranks = run_world(2, interrupted_and_whole, str(tmp_path))
    runs = ranks[0]
    whole = runs["whole"]
    # step 1 on-policy; then one version behind, on-policy again after each checkpoint
    assert [m["staleness_max"] for m in whole] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [m["staleness_mean"] for m in whole] == [0.0, 1.0, 0.0, 1.0, 0.0]
    # the engine mismatch, every step: on stale ones under the weights kept for them
    assert all(m["logprob_mismatch"] < 1e-5 for m in whole), [m["logprob_mismatch"] for m in whole]
    # ... while the learner's own weights have moved on: their KL to the sampler is 1e-3+
    assert all(m["kl_approx"] > 1e-4 for m in whole[1::2]), [m["kl_approx"] for m in whole]
    assert ["logprob_mismatch" in m for m in runs["first"]] == [True, False]
    for got, want in zip(runs["first"] + runs["resumed"], whole, strict=True):
        for key in ("reward_mean", "loss_objective", "grad_norm", "staleness_max"):
            assert got[key] == want[key], key
    for other, mine in zip(ranks[1]["whole"], whole, strict=True):  # metrics are global
        assert other["reward_mean"] == mine["reward_mean"]
    assert [line["step"] for line in training_lines(tmp_path / "cut")] == [1, 2, 3, 4, 5]
    tp = runs["tp"]
    assert [m["staleness_max"] for m in tp] == [0.0, 1.0, 0.0]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in tp), tp
    # SIGTERM between sync points: the queued rollout of step 4 is saved and trained on
    assert len(runs["preempted"]) == 3 and len(runs["after"]) == 2
    # step 4's weights (version 2) are not in the checkpoint of step 3: no mismatch there
    assert ["logprob_mismatch" in m for m in runs["after"]] == [False, True]
    for got, want in zip(runs["preempted"] + runs["after"], whole, strict=True):
        for key in ("reward_mean", "loss_objective", "grad_norm", "staleness_max"):
            assert got[key] == want[key], key


def failing_generator_run(rank: int, root: str) -> str:
    """The generator's third training rollout (group size 8; evaluation samples 4) raises, in
    the pipeline's thread, while the learner trains on step 2."""
    from titan_learner.rollout.hf import HFGenerator

    calls = {"n": 0}
    generate = HFGenerator.generate

    def failing(self, prompts, group_size, *args, **kwargs):
        calls["n"] += group_size == 8
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return generate(self, prompts, group_size, *args, **kwargs)

    HFGenerator.generate = failing
    try:
        short_run(rank, root, 6, ["rollout.max_off_policy_steps=1", "eval.every_steps=0"])
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_generator_failure_in_its_thread_ends_the_job_with_its_error(tmp_path):
    [message] = run_world(1, failing_generator_run, str(tmp_path))
    assert message == (
        "GeneratorFailed: the rollout generator failed in its thread: RuntimeError: CUDA error: "
        "an illegal memory access was encountered"
    )
    assert [line["step"] for line in training_lines(tmp_path)] == [1, 2]


def two_steps_off_policy(rank: int, root: str) -> list[dict]:
    return short_run(rank, root, 5, ["rollout.max_off_policy_steps=2", "eval.every_steps=0"])


def test_two_steps_off_policy_measures_the_mismatch_under_each_kept_version(tmp_path):
    """k=2: steps 3-5 train on rollouts two versions old, so two versions are kept at once
    (one in the frozen model, one as a copy); each stale batch is scored under its own."""
    [history] = run_world(1, two_steps_off_policy, str(tmp_path))
    assert [m["staleness_max"] for m in history] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in history), history
    assert all(m["kl_approx"] > 1e-4 for m in history[2:]), [m["kl_approx"] for m in history]
