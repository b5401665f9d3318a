"""The loss's diagnostics come back in its output (`loss(batch, as_dict=True)`), not as
attributes on the module: the log-prob mismatch and the token means of entropy and clipping,
by hand on rows of varied lengths, on the lean forward and on TorchRL's own (a KL term)."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import VOCAB, batches, tiny_config, with_ref_log_probs
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.local import LocalLearner

LOSSES = {"lean forward": {}, "TorchRL's forward (KL to the reference)": {"kl_to_ref_coeff": 0.1}}


@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_the_output_carries_the_diagnostics_and_the_module_keeps_none(loss):
    learner = LocalLearner(tiny_config(loss={"entropy_bonus": True, **loss}))
    batch = with_ref_log_probs(batches(1, varied=True, seed=4)[0])
    batch = check_batch(batch, VOCAB, needs_ref_log_probs=bool(loss))
    mask = batch[ASSISTANT_MASK_KEY]
    with torch.no_grad():
        logits = learner.policy.token_logits(batch[TOKENS_KEY], batch[ATTENTION_MASK_KEY])
        log_p = torch.log_softmax(logits.float(), -1)
        log_pi = log_p.gather(-1, batch[TOKENS_KEY][..., None])[..., 0]
        entropy = -(log_p.exp() * log_p).sum(-1)
    gap = (log_pi - batch[LOG_PROBS_KEY])[mask].abs()
    ratio = (log_pi - batch[LOG_PROBS_KEY])[mask].exp()

    out = learner.loss_module(batch, as_dict=True)

    assert float(out["logprob_mismatch"]) == pytest.approx(float(gap.mean()), abs=1e-5)
    assert float(out["logprob_mismatch_max"]) == pytest.approx(float(gap.max()), abs=1e-5)
    assert float(out["entropy"]) == pytest.approx(float(entropy[mask].mean()), rel=1e-5)
    low, high = (ratio < 0.8).float().mean(), (ratio > 1.2).float().mean()
    assert float(out["clip_fraction_low"]) == pytest.approx(float(low), abs=1e-6)
    assert float(out["clip_fraction_high"]) == pytest.approx(float(high), abs=1e-6)
    assert float(low + high) > 0, "the batch's log-probs are off the policy: some ratios clip"
    left = set(vars(learner.loss_module)) & {"forward_values", "logprob_mismatch", "_weighed"}
    assert left == set(), "the forward's values are dropped when it returns"


def test_the_update_reports_what_the_loss_output_carries():
    learner, twin = LocalLearner(tiny_config()), LocalLearner(tiny_config())
    batch = batches(1, varied=True, seed=6)[0]
    out = twin.loss_module(check_batch(batch, VOCAB, needs_ref_log_probs=False), as_dict=True)
    metrics = learner.update(batch)
    for key in ("logprob_mismatch", "logprob_mismatch_max", "entropy", "clip_fraction_high"):
        torch.testing.assert_close(metrics[key], out[key].detach().float(), msg=key)
