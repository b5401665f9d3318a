"""The table of [loss] values (`titan_learner.config.loss_values`) held to TorchRL 0.14.1.

Each test fails loudly on a TorchRL upgrade that changes what the table rests on: a parameter
added or removed, a Literal's values, or the behaviour that makes a value TorchRL takes one the
learner refuses (an unknown aggregation trained as token_mean, `reduction = "sum"` ignored,
`gamma` and `clip_value` never read). The messages themselves: the bad-config tables of
tests/unit/test_config.py and tests/unit/test_train_and_check_agree.py.
"""

from __future__ import annotations

import inspect
import typing

import pytest
import torch
from torchrl.objectives.llm import GRPOLoss

from titan_learner.config.loss_values import AGGREGATIONS, LOSS_KEYS, UNREAD_KEYS
from titan_learner.config.validate import (
    LOSS_CLASSES,
    NAMED_LOSS_KEYS,
    PROJECT_LOSS_KEYS,
    loss_class,
)
from titan_learner.learner.loss.normalization import AGGREGATION_COUNTS

NOT_CONFIGURABLE = {"self", "actor_network", "device", "kwargs"}


def per_token_terms() -> tuple[torch.Tensor, torch.Tensor]:
    """Loss terms `[B, T, 1]` of 3 rows training 4, 1 and 2 tokens (left padding)."""
    value = torch.arange(1.0, 16.0).reshape(3, 5, 1)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    return value, mask


@pytest.mark.parametrize("name", list(LOSS_CLASSES))
def test_every_torchrl_parameter_is_described(name):
    takes = set(inspect.signature(loss_class(name).__init__).parameters) - NOT_CONFIGURABLE
    named = {key for keys in NAMED_LOSS_KEYS.values() for key in keys}
    described = set(LOSS_KEYS) - set(PROJECT_LOSS_KEYS) - named
    assert takes == described | set(UNREAD_KEYS)


def test_literal_parameters_allow_what_torchrl_declares():
    hints = typing.get_type_hints(GRPOLoss.__init__)
    literals = {k: v for k, v in hints.items() if typing.get_origin(v) is typing.Literal}
    assert set(literals) == {"masking_strategy", "ref_log_prob_padding_side"}
    for key, hint in literals.items():
        assert typing.get_args(LOSS_KEYS[key].kind) == typing.get_args(hint), key


def test_the_normalization_knows_exactly_the_allowed_aggregations():
    assert tuple(AGGREGATION_COUNTS) == AGGREGATIONS
    assert typing.get_args(LOSS_KEYS["aggregation"].kind) == AGGREGATIONS


def test_torchrl_trains_an_unknown_aggregation_as_token_mean():
    """Why the names are checked: verl's "seq-mean-token-sum" would silently be this."""
    value, mask = per_token_terms()
    unknown = GRPOLoss(None, aggregation="seq-mean-token-sum")._aggregate_loss_value(value, mask)
    assert torch.equal(unknown, value.squeeze(-1)[mask].mean())
    assert float(unknown) == pytest.approx(53 / 7)  # 7 tokens summing to 53; verl's mode: 53 / 3


@pytest.mark.parametrize("aggregation", ["token_mean", "prompt_mean"])  # TorchRL's own
def test_torchrl_ignores_a_summed_reduction(aggregation):
    value, mask = per_token_terms()
    mean = GRPOLoss(None, aggregation=aggregation)._aggregate_loss_value(value, mask)
    summed = GRPOLoss(None, aggregation=aggregation, reduction="sum")
    assert torch.equal(summed._aggregate_loss_value(value, mask), mean)
    by_hand = {"token_mean": 53 / 7, "prompt_mean": (14 / 4 + 10 + 29 / 2) / 3}[aggregation]
    assert float(mean) == pytest.approx(by_hand)


def test_torchrl_none_leaves_a_loss_per_token():
    value, mask = per_token_terms()
    for kwargs in ({"aggregation": "none"}, {"reduction": "none"}):
        assert GRPOLoss(None, **kwargs)._aggregate_loss_value(value, mask).shape == (3, 5, 1)


def test_torchrl_never_reads_gamma_or_clip_value():
    plain, given = GRPOLoss(None), GRPOLoss(None, **dict.fromkeys(UNREAD_KEYS, 0.5))

    def public(module):
        return {k: v for k, v in vars(module).items() if not k.startswith("_")}

    assert public(given) == public(plain)
    assert given.state_dict().keys() == plain.state_dict().keys()
    assert not any(hasattr(given, key) for key in UNREAD_KEYS)
