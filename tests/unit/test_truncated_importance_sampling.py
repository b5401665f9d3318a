"""`[loss] tis_cap`: each trained token weighted by min(pi / mu, C) against the behaviour policy."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.models import batches, tiny_config
from titan_learner.config.errors import ConfigError
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY, TOKENS_KEY
from titan_learner.learner.local import LocalLearner

CAP = 1.5


def learner(**loss) -> LocalLearner:
    """No entropy bonus and no gradient clipping: the objective alone moves the weights."""
    return LocalLearner(
        tiny_config(loss={"entropy_bonus": False, **loss}, learner={"clip_norm": 0.0})
    )


def stale_batch():
    """Behaviour log-probs from 'another policy': the learner's own, shifted by -1 to +1, so
    that pi / mu runs from 0.37 to 2.7 over the tokens."""
    batch = batches(1, varied=True)[0]
    with torch.no_grad():
        dist = learner().policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
        current = dist.log_prob(batch.get(TOKENS_KEY))
    shift = torch.linspace(-1.0, 1.0, current.numel()).view_as(current)
    mask = batch.get(ASSISTANT_MASK_KEY)
    batch.set(LOG_PROBS_KEY, torch.where(mask, current - shift, torch.nan))
    return batch


def test_the_objective_is_the_truncated_weight_times_the_advantage():
    batch = stale_batch()
    capped = learner(tis_cap=CAP)
    with torch.no_grad():
        dist = capped.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
        current = dist.log_prob(batch.get(TOKENS_KEY))
    mask = batch.get(ASSISTANT_MASK_KEY)
    log_ratio = (current - batch.get(LOG_PROBS_KEY))[mask]
    advantage = batch.get("advantage").reshape(-1, 1).expand_as(mask)[mask]
    weight = log_ratio.exp().clamp(max=CAP)
    metrics = capped.update(batch)
    assert float(metrics["loss_objective"]) == pytest.approx(
        float(-(weight * advantage).mean()), rel=1e-5
    )
    truncated = float((log_ratio > math.log(CAP)).float().mean())
    assert 0.05 < truncated < 0.95, "the fixture must truncate some tokens and not others"
    assert float(metrics["tis_truncated"]) == pytest.approx(truncated, abs=1e-6)


def test_the_gradient_is_the_weighted_policy_gradient():
    """Same gradients as a hand-written loss: -mean(min(pi/mu, C).detach() * A * log pi)."""
    batch = stale_batch()
    by_hand = learner()
    dist = by_hand.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
    log_pi = dist.log_prob(batch.get(TOKENS_KEY))
    mask = batch.get(ASSISTANT_MASK_KEY)
    weight = (log_pi.detach() - batch.get(LOG_PROBS_KEY)).exp().clamp(max=CAP)
    advantage = batch.get("advantage").reshape(-1, 1).expand_as(mask)
    (-(weight * advantage * log_pi)[mask].mean()).backward()
    expected = {n: p.grad for n, p in by_hand.model.named_parameters()}
    got = gradients_of_one_update(batch)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-7, rtol=1e-4, msg=name)


def gradients_of_one_update(batch) -> dict[str, torch.Tensor]:
    """The gradients the capped loss takes (no clipping), read at its optimizer step."""
    capped = learner(tis_cap=CAP, clip_epsilon=0.2)
    grads: dict[str, torch.Tensor] = {}
    step = capped.optimizer.step

    def record(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in capped.model.named_parameters()})
        return step(*args, **kwargs)

    capped.optimizer.step = record
    capped.update(batch)
    return grads


@pytest.mark.parametrize(
    ("cap", "message"),
    [
        (0.5, "0.5 is out of range; allowed: >= 1"),
        ("big", "expected a number, got 'big'"),
        (True, "expected a number, got True"),
        (float("inf"), "inf is not a finite number; allowed: a finite number"),
    ],
)
def test_tis_cap_must_be_a_number_of_at_least_one(cap, message):
    with pytest.raises(ConfigError) as err:
        tiny_config(loss={"tis_cap": cap})
    assert str(err.value) == f"tests: [loss] tis_cap: {message}"
