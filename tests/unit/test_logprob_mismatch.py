"""`logprob_mismatch` / `logprob_mismatch_max` in every update's metrics: the mean and largest
|learner log-prob - batch log-prob| over the trained tokens, for the weights that the step
starts from (the trainer-vs-generator mismatch in the synchronous loop)."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import batches, tiny_config
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.normalization import step_counts


def learner_log_probs(learner, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = learner.policy.token_logits(batch[TOKENS_KEY], batch[ATTENTION_MASK_KEY])
    return torch.log_softmax(logits.float(), -1).gather(-1, batch[TOKENS_KEY][..., None])[..., 0]


def test_the_mismatch_is_measured_against_the_weights_the_step_starts_from():
    learner = LocalLearner(tiny_config())
    batch = batches(1, varied=True)[0]
    mask = batch[ASSISTANT_MASK_KEY]
    gap = (learner_log_probs(learner, batch) - batch[LOG_PROBS_KEY])[mask].abs()
    metrics = learner.update(batch)
    assert float(metrics["logprob_mismatch"]) == pytest.approx(float(gap.mean()), abs=1e-5)
    assert float(metrics["logprob_mismatch_max"]) == pytest.approx(float(gap.max()), abs=1e-5)


def test_a_batch_sampled_from_the_learners_own_weights_has_no_mismatch():
    learner = LocalLearner(tiny_config())
    batch = batches(1, varied=True)[0]
    mask = batch[ASSISTANT_MASK_KEY]
    on_policy = batch.clone()
    on_policy.set(LOG_PROBS_KEY, torch.where(mask, learner_log_probs(learner, batch), 0.0))
    metrics = learner.update(on_policy)
    assert float(metrics["logprob_mismatch_max"]) < 1e-5


def test_over_micro_batches_the_mean_is_token_weighted_and_the_max_is_the_largest():
    whole = LocalLearner(tiny_config())
    split = LocalLearner(tiny_config(learner={"grad_accum_steps": 2}))
    batch = batches(1, varied=True)[0]
    expected = whole.update(batch)
    micros = [batch[:3], batch[3:]]  # unequal token counts
    counts = step_counts(micros)
    for micro in micros:
        got = split.update(micro, step_counts=counts)
    for key in ("logprob_mismatch", "logprob_mismatch_max"):
        assert float(got[key]) == pytest.approx(float(expected[key]), abs=1e-6), key
