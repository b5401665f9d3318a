"""`[loss.correction]`: off-policy correction against the behaviour policy, by hand.

Each token's weight w = f(r), r = pi / mu (token level) or its row's geometric mean of the
token ratios (sequence level); truncate: min(r, high) (TIS; verl rollout_corr "truncate");
mask: r inside [low, high], 0 outside (IcePop at token level; verl "mask"). The objective is
GRPO's on the current policy (ratio pi / sg(pi)) times sg(w): written out on log-probs of a
transformers model run on each row unpadded, values, gradients and the reported fractions.
"""

from __future__ import annotations

import math

import pytest
import torch

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
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.learner.batch import ADVANTAGE_KEY, ASSISTANT_MASK_KEY, LOG_PROBS_KEY
from titan_learner.learner.local import LocalLearner

# name -> ([loss] keys, level, mode, low, high)
CASES = {
    "token truncate": (
        {"correction": {"level": "token", "mode": "truncate", "high": 1.5}},
        "token",
        "truncate",
        0.0,
        1.5,
    ),
    "tis_cap alias": ({"tis_cap": 1.5}, "token", "truncate", 0.0, 1.5),
    "token mask (IcePop)": (
        {"correction": {"level": "token", "mode": "mask", "low": 0.5, "high": 2.0}},
        "token",
        "mask",
        0.5,
        2.0,
    ),
    "token mask low defaults to 1 / high": (
        {"correction": {"mode": "mask", "high": 1.5}},
        "token",
        "mask",
        1 / 1.5,
        1.5,
    ),
    "sequence truncate": (
        {"correction": {"level": "sequence", "mode": "truncate", "high": 1.2}},
        "sequence",
        "truncate",
        0.0,
        1.2,
    ),
    "sequence mask": (
        {"correction": {"level": "sequence", "mode": "mask", "low": 0.9, "high": 1.1}},
        "sequence",
        "mask",
        0.9,
        1.1,
    ),
    # TorchRL's own forward (a KL term of weight 0)
    "sequence mask torchrl forward": (
        {
            "correction": {"level": "sequence", "mode": "mask", "low": 0.9, "high": 1.1},
            "kl_to_inference_coeff": 0.0,
        },
        "sequence",
        "mask",
        0.9,
        1.1,
    ),
}


def correction_by_hand(log_pi, log_mu, advantage, rows, count, level, mode, low, high):
    """Per token -sg(w) A pi / sg(pi) (GRPO's clipped objective at ratio 1), the ratio r the
    weight is made from, and which tokens the bounds truncated or masked."""
    log_ratio = (log_pi - log_mu).detach()
    if level == "sequence":  # the geometric mean of the row's token ratios
        log_ratio = row_means(log_ratio, rows, count)[rows]
    ratio = log_ratio.exp()
    if mode == "truncate":
        weight, cut = ratio.clamp(max=high), ratio > high
    else:
        cut = (ratio < low) | (ratio > high)
        weight = torch.where(cut, 0.0, ratio)
    on_policy = (log_pi - log_pi.detach()).exp()
    return -weight * advantage * on_policy, ratio, cut


def learner_and_twin(loss: dict):
    """A learner with `[loss] loss` (no entropy bonus, no clipping of the norm), its
    transformers twin, the clipping batch, and the by-hand inputs: each trained token's
    advantage, log pi, row, and the count of rows."""
    trained = LocalLearner(
        tiny_config(loss={"entropy_bonus": False, **loss}, learner={"clip_norm": 0.0})
    )
    model = transformers_twin(trained)
    batch = clipping_batch(model)
    mask = batch.get(ASSISTANT_MASK_KEY)
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)[mask]
    inputs = (advantage, response_log_probs(model, batch), token_rows(batch), mask.shape[0])
    return trained, model, batch, inputs


def corrected(batch, advantage, log_pi, rows, count, level, mode, low, high):
    """GRPO's corrected terms by hand, checking the fixture cuts some tokens and not others."""
    log_mu = batch.get(LOG_PROBS_KEY)[batch.get(ASSISTANT_MASK_KEY)]
    terms, ratio, cut = correction_by_hand(
        log_pi, log_mu, advantage, rows, count, level, mode, low, high
    )
    assert 0.05 < cut.float().mean() < 0.95, "the fixture must cut some tokens and not others"
    return terms, ratio, cut


@pytest.mark.parametrize("case", list(CASES))
def test_values_gradients_and_fractions_are_the_correction_by_hand(case):
    loss, level, mode, low, high = CASES[case]
    trained, model, batch, (advantage, log_pi, rows, count) = learner_and_twin(loss)
    terms, ratio, cut = corrected(batch, advantage, log_pi, rows, count, level, mode, low, high)
    terms.mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert metrics["loss_objective"] == pytest.approx(terms.mean().item(), rel=1e-5, abs=1e-7)
    share = float(cut.float().mean())
    truncated, masked = (share, 0.0) if mode == "truncate" else (0.0, share)
    assert metrics["correction/truncated_fraction"] == pytest.approx(truncated, abs=1e-6)
    assert metrics["correction/masked_fraction"] == pytest.approx(masked, abs=1e-6)
    assert metrics["correction/ratio_mean"] == pytest.approx(float(ratio.mean()), rel=1e-5)
    assert metrics["correction/ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-5)
    assert ("tis_truncated" in metrics) == ("tis_cap" in loss)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


OTHER_LOSSES = {
    "cispo": {"name": "cispo", "clip_epsilon": [0.2, 0.28]},
    "gspo": {"name": "gspo", "clip_epsilon": [0.2, 0.28]},
}


def objective_at_ratio_one(loss: str, log_pi, advantage, rows, count):
    """Each token's objective on the current policy, before the weight: CISPO -A log pi (its
    clipped weight sg(clip(pi / sg(pi))) is 1); GSPO -A s, s = exp(row mean of
    log pi - sg(log pi)), 1 in value, the row's mean log-prob gradient on each token."""
    if loss == "cispo":
        return -advantage * log_pi
    log_s = row_means(log_pi - log_pi.detach(), rows, count)[rows]
    return -advantage * log_s.exp()


@pytest.mark.parametrize("case", ["token truncate", "sequence truncate", "sequence mask"])
@pytest.mark.parametrize("loss", list(OTHER_LOSSES))
def test_cispo_and_gspo_take_the_correction_as_a_weight_on_their_own_objective(loss, case):
    """The correction means for CISPO and GSPO what it means for GRPO: the loss's objective on
    the current policy, each token's term times sg(w); for GSPO at token level each token's w
    weighs its row's sequence-ratio gradient (the row's mean w, in effect)."""
    keys, level, mode, low, high = CASES[case]
    trained, model, batch, (advantage, log_pi, rows, count) = learner_and_twin(
        {**OTHER_LOSSES[loss], **keys}
    )
    grpo_terms, _, _ = corrected(batch, advantage, log_pi, rows, count, level, mode, low, high)
    weight = grpo_terms.detach() / -advantage  # sg(w): GRPO's term at ratio 1 is -w A
    terms = weight * objective_at_ratio_one(loss, log_pi, advantage, rows, count)
    # each loss's default aggregation: cispo token_mean, gspo prompt_mean (the mean of row means)
    objective = terms.mean() if loss == "cispo" else row_means(terms, rows, count).mean()
    objective.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert metrics["loss_objective"] == pytest.approx(objective.item(), rel=1e-5, abs=1e-7)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_no_correction_reports_none():
    trained = LocalLearner(tiny_config())
    metrics, _ = update_with_gradients(trained, clipping_batch(transformers_twin(trained)))
    assert not any(key.startswith("correction/") for key in metrics)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (
            {"tis_cap": 2.0, "correction": {"high": 2.0}},
            "[loss] tis_cap: tis_cap = C is [loss.correction] level = 'token', mode = "
            "'truncate', high = C; allowed: one of them",
        ),
        (
            {"correction": {"mode": "truncate", "low": 0.5}},
            "[loss.correction] low: low = 0.5 bounds the ratios mode = 'mask' keeps; "
            "'truncate' caps the ratio from above only (min(r, high)); allowed: leave low "
            "out, or mode = 'mask'",
        ),
        (
            {"correction": {"level": "row"}},
            "[loss.correction] level: 'row' is not allowed; allowed: 'token', 'sequence'",
        ),
        (
            {"correction": {"mode": "mask", "high": 0.5}},
            "[loss.correction] high: 0.5 is out of range; allowed: >= 1.0",
        ),
        (
            {"correction": {"mode": "mask", "low": 1.5}},
            "[loss.correction] low: 1.5 is out of range; allowed: >= 0.0 and <= 1.0",
        ),
        (
            {"correction": {"cap": 2.0}},
            "[loss.correction]: unknown key 'cap'; allowed keys: high, level, low, mode",
        ),
        ({"correction": 2.0}, "[loss] correction: expected a [loss.correction] table, got 2.0"),
    ],
)
def test_a_bad_correction_is_one_clear_config_error(loss, message):
    with pytest.raises(ConfigError) as err:
        tiny_config(loss=loss)
    assert str(err.value) == f"tests: {message}"


def test_the_correction_table_round_trips_through_toml():
    import tomllib

    config = tiny_config(loss={"correction": {"level": "sequence", "mode": "mask", "high": 3.0}})
    text = config_to_toml(config)
    assert "[loss.correction]" in text
    again = config_from_dict(tomllib.loads(text), source="tests")
    assert again.loss == config.loss
    assert math.isclose(again.loss.kwargs["correction"]["high"], 3.0)
