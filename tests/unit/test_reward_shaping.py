"""DAPO's overlong shaping and filtering, and the `[kl]` / batch-shaping config rules.

The soft overlong punishment is checked against DAPO's formula (section 3.4) written out by
hand; every contradictory or meaningless setting is one ConfigError line before any compute.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.models import batches, tiny_config
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.job.reward_shaping import overlong_penalty, without_truncated
from titan_learner.job.validate import validate
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY, trained_mask

TOY = Path(__file__).parents[2] / "configs" / "toy_grpo.toml"


def dapo_by_hand(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO eq. 13: 0 up to L_max - L_cache, then (L_max - L_cache - |y|) / L_cache."""
    if length <= max_len - buffer:
        return 0.0
    return (max_len - buffer - length) / buffer * penalty


def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer():
    lengths = torch.tensor([1, 12, 16, 17, 18, 19, 20])
    got = overlong_penalty(lengths, max_new_tokens=20, buffer=4, penalty=0.5)
    want = [dapo_by_hand(n, 20, 4, 0.5) for n in lengths.tolist()]
    torch.testing.assert_close(got, torch.tensor(want))
    assert got[-1] == -0.5 and got[2] == 0.0
    assert not overlong_penalty(lengths, 20, 0, 1.0).any(), "buffer 0: off"


def test_mask_truncated_trains_no_token_of_a_truncated_row_and_keeps_the_rest():
    batch = batches(1, varied=True)[0]
    finished = torch.tensor([True, False, True, True, False, True, True, True])
    out = without_truncated(batch, finished)
    mask = trained_mask(out.get(ASSISTANT_MASK_KEY), out.get(LOG_PROBS_KEY))
    assert not mask[~finished].any()
    before = trained_mask(batch.get(ASSISTANT_MASK_KEY), batch.get(LOG_PROBS_KEY))
    assert torch.equal(mask[finished], before[finished]) and before[~finished].any()
    assert not math.isnan(float(batch.get(LOG_PROBS_KEY)[1][before[1]][0])), "input unchanged"


REFUSED = {
    "kl coeff in the loss": (
        {"kl": {"coeff": 0.1}},
        "tests: [kl] coeff: coeff = 0.1 with placement = 'loss': the KL in the loss is TorchRL's, "
        "its coefficient is [loss] kl_to_ref_coeff; allowed: [loss] kl_to_ref_coeff = 0.1, or "
        "[kl] placement = 'reward'",
    ),
    "an estimator with no KL": (
        {"kl": {"estimator": "k2"}},
        "tests: [kl] estimator: 'k2' with no KL (placement = 'loss' and no [loss] "
        "kl_to_ref_coeff) estimates nothing; allowed: [loss] kl_to_ref_coeff > 0, or "
        "placement = 'reward' with [kl] coeff > 0",
    ),
    "two KLs": (
        {"kl": {"placement": "reward", "coeff": 0.1}, "loss": {"kl_to_ref_coeff": 0.1}},
        "tests: [kl] placement: placement = 'reward' and [loss] kl_to_ref_coeff = 0.1 would count "
        "the KL twice; allowed: one of them ([kl] coeff for the reward)",
    ),
    "a reward KL of 0": (
        {"kl": {"placement": "reward"}},
        "tests: [kl] coeff: placement = 'reward' with coeff = 0 penalizes nothing; "
        "allowed: coeff > 0",
    ),
    "an unknown estimator": (
        {"kl": {"placement": "reward", "coeff": 0.1, "estimator": "k4"}},
        "tests: [kl] estimator: 'k4' is not allowed; allowed: 'k1', 'k2', 'k3'",
    ),
    "mask_truncated not a boolean": (
        {"loss": {"mask_truncated": 1}},
        "tests: [loss] mask_truncated: expected true or false, got 1",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_contradictory_settings_are_one_line(case):
    sections, message = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        tiny_config(**sections)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.dynamic_sampling=true", "rollout.max_off_policy_steps=1"],
            "[rollout] dynamic_sampling: dynamic_sampling scores every round before sampling the "
            "next; with max_off_policy_steps = 1 rollouts are sampled ahead in a thread; "
            "allowed: max_off_policy_steps = 0 with dynamic_sampling",
        ),
        (
            ["rollout.overlong_buffer=9"],
            "[rollout] overlong_buffer: 9 tokens is longer than max_new_tokens = 8; "
            "allowed: 0 (off) to 8",
        ),
        (["rollout.max_sampling_rounds=0"], "[rollout] max_sampling_rounds: 0 is out of range"),
    ],
)
def test_batch_shaping_is_checked_before_any_compute(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(TOY, overrides), 1)
    assert message in str(err.value)


def test_the_dapo_settings_pass_on_the_toy_and_survive_the_resolved_config():
    """What a checkpoint root keeps (`config_to_toml`) reads back to the same settings."""
    import tomllib

    from titan_learner.config.toml import config_from_dict, config_to_toml

    keys = [
        "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=4",
        "rollout.overlong_buffer=4",
        "rollout.overlong_penalty=0.5",
        "loss.mask_truncated=true",
        'kl.placement="reward"',
        "kl.coeff=0.001",
        'kl.estimator="k2"',
    ]
    config = load_config(TOY, keys)
    validate(config, 1)
    again = config_from_dict(tomllib.loads(config_to_toml(config)), config.source)
    assert (again.kl, again.rollout, again.loss) == (config.kl, config.rollout, config.loss)
