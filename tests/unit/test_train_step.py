"""`Learner.train_step(rank_batch, reference)`: the split, the step's counts and the reference's
scoring in one call, the same step as the loop the job ran before it (chunk by count or one
token-budget update, step_counts, reference log-probs scored per micro-batch).

Rows of varied lengths (2 to 16 real tokens); the reference is the real frozen ReferenceModel,
and after a first step the policy differs from it, so the KL term and its gradient are not zero.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import SEQ_LEN, batches, state, tiny_config, with_ref_log_probs
from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import REF_LOG_PROBS_KEY
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.normalization import step_counts
from titan_learner.learner.reference_scoring import with_reference_log_probs

SPLITS = {
    "by count": {"grad_accum_steps": 2},
    "by tokens": {"max_tokens_per_microbatch": 2 * SEQ_LEN},
}


def config(split: dict):
    return tiny_config(
        loss={"kl_to_ref_coeff": 0.1}, learner={"clip_norm": 1.0, **split}, run={"seed": 0}
    )


def old_loop(learner: LocalLearner, batch, reference, split: dict) -> dict[str, torch.Tensor]:
    """What job/grpo.py::train_on did before train_step, written out."""
    budget = split.get("max_tokens_per_microbatch", 0)
    parts = 1 if budget else split["grad_accum_steps"]
    batch = with_reference_log_probs(batch, reference, parts)
    micros = [batch] if budget else batch.chunk(parts)
    counts = None if budget else step_counts(micros)
    for micro in micros:
        metrics = learner.update(micro, step_counts=counts)
    return dict(metrics.items())


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_train_step_is_the_jobs_old_loop_params_and_metrics(split):
    reference = ReferenceModel(config(split))
    old, new = LocalLearner(config(split)), LocalLearner(config(split))
    for batch in batches(2, varied=True, seed=11):
        expected = old_loop(old, batch, reference, split)
        got = dict(new.train_step(batch, reference).items())
        assert set(got) == set(expected)
        assert "grad_norm" in got, "the returned metrics are the stepping call's"
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=key)
    assert got["kl_to_ref"] > 1e-6, "the policy moved off the reference: a KL to train on"
    assert new.step == old.step == 2
    for name, value in state(old.model).items():
        torch.testing.assert_close(state(new.model)[name], value, atol=0, rtol=0, msg=name)


def test_train_step_keeps_the_reference_log_probs_a_batch_carries():
    """A batch the caller scored already (the job, for a KL in the reward or `mask_truncated`)
    trains on its own log-probs, not on a second scoring by the reference."""
    split = SPLITS["by count"]
    reference = ReferenceModel(config(split))
    batch = with_ref_log_probs(batches(1, varied=True, seed=5)[0])
    carried, scored = LocalLearner(config(split)), LocalLearner(config(split))
    got = carried.train_step(batch, reference)
    again = scored.train_step(batch.exclude(REF_LOG_PROBS_KEY), reference)
    torch.testing.assert_close(got["loss_objective"], again["loss_objective"])
    expected = LocalLearner(config(split)).train_step(batch)
    for key in ("kl_to_ref", "loss_kl_to_ref", "grad_norm"):
        torch.testing.assert_close(got[key], expected[key], atol=0, rtol=0, msg=key)
        assert got[key] != again[key], key
