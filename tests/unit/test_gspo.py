"""`[loss] name = "gspo"` is GSPO (Zheng et al., 2025): the sequence ratio, clipped per sequence.

The learner's loss values, clip fractions and gradients are checked against the paper's
objective written out by hand (eq. 5 and 7; GSPO-token, eq. 13) on log-probs of a transformers
model (the learner's exported weights), each row run unpadded, on rows of their own lengths
whose behaviour log-probs put sequence ratios inside and outside the bounds under both signs
of advantage.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torchrl.objectives.llm import GRPOLoss

from tests.support.by_hand import (
    clipping_batch,
    response_log_probs,
    row_means,
    token_rows,
    transformers_twin,
    update_with_gradients,
)
from tests.support.models import tiny_config
from titan_learner.config.errors import ConfigError
from titan_learner.learner.batch import ADVANTAGE_KEY, ASSISTANT_MASK_KEY, LOG_PROBS_KEY
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.gspo import GSPO_CLIP_EPSILON, GSPOLoss

# [loss] table -> (GSPO-token?, lower and upper clip epsilon, aggregation)
CASES = {
    "gspo": ({}, False, *GSPO_CLIP_EPSILON, "prompt_mean"),
    "gspo [0.2, 0.28]": ({"clip_epsilon": [0.2, 0.28]}, False, 0.2, 0.28, "prompt_mean"),
    "gspo-token [0.2, 0.28]": (
        {"clip_epsilon": [0.2, 0.28], "gspo_token": True},
        True,
        0.2,
        0.28,
        "prompt_mean",
    ),
    # TorchRL's own forward (a KL term of weight 0)
    "gspo torchrl forward": (
        {"clip_epsilon": 0.2, "kl_to_inference_coeff": 0.0},
        False,
        0.2,
        0.2,
        "prompt_mean",
    ),
    "gspo token_mean": (
        {"clip_epsilon": [0.2, 0.28], "aggregation": "token_mean"},
        False,
        0.2,
        0.28,
        "token_mean",
    ),
}


def learner(loss: dict) -> LocalLearner:
    """No entropy bonus and no gradient clipping: the objective alone makes the gradient."""
    return LocalLearner(
        tiny_config(
            loss={"name": "gspo", "entropy_bonus": False, **loss}, learner={"clip_norm": 0.0}
        )
    )


def gspo_by_hand(log_pi, log_mu, advantage, rows, count, low, high, token_form):
    """Per token, -min(s A, clip(s, 1 - low, 1 + high) A) with s its row's ratio: the
    sequence's s_i = exp(mean over its tokens of log pi - log mu) (eq. 7), or GSPO-token's
    s_i,t = sg(s_i) pi_t / sg(pi_t) (eq. 13); and whether the bounds changed s."""
    log_s = row_means(log_pi - log_mu, rows, count)[rows]
    if token_form:
        log_s = log_s.detach() + log_pi - log_pi.detach()
    ratio = log_s.exp()
    clipped = ratio.clamp(1 - low, 1 + high)
    return -torch.minimum(ratio * advantage, clipped * advantage), clipped != ratio


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_are_the_paper_by_hand(case):
    loss, token_form, low, high, aggregation = CASES[case]
    trained = learner(loss)
    model = transformers_twin(trained)
    batch = clipping_batch(model)
    mask = batch.get(ASSISTANT_MASK_KEY)
    log_mu = batch.get(LOG_PROBS_KEY)[mask]
    rows, count = token_rows(batch), mask.shape[0]
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)[mask]
    log_pi = response_log_probs(model, batch)
    terms, clipped = gspo_by_hand(log_pi, log_mu, advantage, rows, count, low, high, token_form)
    if aggregation == "prompt_mean":  # eq. 5: 1/G sum_i of each sequence's (equal) terms
        loss_value = row_means(terms, rows, count).mean()
    else:
        loss_value = terms.mean()
    sequences = {
        (bool(c), bool(a > 0)) for c, a in zip(clipped.tolist(), advantage.tolist(), strict=True)
    }
    assert len(sequences) == 4 or low < 1e-3, "sequences in and out of bounds, A > 0 and < 0"
    loss_value.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert metrics["loss_objective"] == pytest.approx(loss_value.item(), rel=1e-5, abs=1e-7)
    clip_fraction = float(clipped.float().mean())  # over tokens: a row's weighs its length
    assert metrics["clip_fraction"] == pytest.approx(clip_fraction, abs=1e-6)
    assert metrics["clip_fraction_low"] + metrics["clip_fraction_high"] == pytest.approx(
        clip_fraction, abs=1e-6
    )
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_paper_bounds_are_the_default():
    loss = learner({}).loss_module
    assert isinstance(loss, GSPOLoss) and loss.aggregation == "prompt_mean"
    assert (float(loss.clip_epsilon_low), float(loss.clip_epsilon_high)) == pytest.approx(
        GSPO_CLIP_EPSILON
    )
    assert loss.gspo_token is False


def test_gspo_token_is_a_gspo_key():
    with pytest.raises(ConfigError) as err:
        tiny_config(loss={"name": "grpo", "gspo_token": True})
    assert "unknown key 'gspo_token' for loss 'grpo'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        tiny_config(loss={"name": "gspo", "gspo_token": "yes"})
    assert str(err.value) == "tests: [loss] gspo_token: expected true or false, got 'yes'"


def test_the_torchrl_methods_gspo_overrides_keep_their_signatures():
    """When this fails, TorchRL changed a method `GSPOLoss` overrides: adapt it."""
    overridden = {
        "_compute_policy_objective": ["self", "log_weight", "advantage"],
        "_get_cur_log_prob": ["self", "tensordict"],
    }
    for name, parameters in overridden.items():
        assert list(inspect.signature(getattr(GRPOLoss, name)).parameters) == parameters, name
    assert GSPOLoss.forward is GRPOLoss.forward
