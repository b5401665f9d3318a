"""`[loss] aggregation`: each allowed mode, for every loss, is its formula by hand.

verl's names: token_mean "token-mean", prompt_mean "seq-mean-token-mean", seq_mean_token_sum
"seq-mean-token-sum", seq_mean_token_sum_norm "seq-mean-token-sum-norm" (Dr. GRPO: the sum over
tokens divided by rows x max_new_tokens). Per-token terms of GRPO, CISPO and GSPO written out
on log-probs of a transformers model run on each row unpadded; values and gradients. (Exact
across micro-batches: tests/unit/test_normalization.py; across ranks: test_parity.py.)
"""

from __future__ import annotations

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
from titan_learner.config.loss_values import AGGREGATIONS, VERL_AGGREGATIONS
from titan_learner.learner.batch import ADVANTAGE_KEY, ASSISTANT_MASK_KEY, LOG_PROBS_KEY
from titan_learner.learner.local import LocalLearner

MAX_NEW_TOKENS = 24  # the constant of seq_mean_token_sum_norm, above the longest row's 15
LOSSES = {
    "grpo": {"name": "grpo"},
    "dapo": {"name": "dapo", "clip_epsilon": [0.2, 0.28]},  # DAPO's decoupled clip bounds
    "cispo": {"name": "cispo", "clip_epsilon": [0.2, 0.28]},
    "gspo": {"name": "gspo", "clip_epsilon": [0.2, 0.28]},
}


def terms_by_hand(loss: str, log_pi, log_mu, advantage, rows, count):
    """Each response token's loss term: GRPO -min(r A, clip(r, 0.8, 1.2) A); DAPO the same
    with its decoupled bounds, clip(r, 0.8, 1.28); CISPO
    -sg(clip(r, 0.8, 1.28)) A log pi; GSPO -min(s A, clip(s, 0.8, 1.28) A), s the row's
    exp(mean of log r)."""
    log_ratio = log_pi - log_mu
    if loss == "cispo":
        return -log_ratio.detach().exp().clamp(0.8, 1.28) * advantage * log_pi
    if loss == "gspo":
        log_ratio = row_means(log_ratio, rows, count)[rows]
    ratio = log_ratio.exp()
    high = 1.2 if loss == "grpo" else 1.28
    return -torch.minimum(ratio * advantage, ratio.clamp(0.8, high) * advantage)


def aggregate_by_hand(aggregation: str, terms, rows, count) -> torch.Tensor:
    """token_mean: over all tokens; prompt_mean: the mean of row means; seq_mean_token_sum: the
    mean of row sums; seq_mean_token_sum_norm: the sum over rows x MAX_NEW_TOKENS."""
    if aggregation == "token_mean":
        return terms.mean()
    if aggregation == "prompt_mean":
        return row_means(terms, rows, count).mean()
    if aggregation == "seq_mean_token_sum":
        return torch.zeros(count).index_add(0, rows, terms).mean()
    return terms.sum() / (count * MAX_NEW_TOKENS)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_each_aggregation_of_each_loss_is_its_formula_by_hand(loss, aggregation):
    trained = LocalLearner(
        tiny_config(
            loss={**LOSSES[loss], "entropy_bonus": False, "aggregation": aggregation},
            learner={"clip_norm": 0.0},
            rollout={"max_new_tokens": MAX_NEW_TOKENS},
        )
    )
    model = transformers_twin(trained)
    batch = clipping_batch(model)
    mask = batch.get(ASSISTANT_MASK_KEY)
    rows, count = token_rows(batch), mask.shape[0]
    assert len(set(torch.bincount(rows).tolist())) > 3, "rows of many lengths"
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)[mask]
    log_pi = response_log_probs(model, batch)
    terms = terms_by_hand(loss, log_pi, batch.get(LOG_PROBS_KEY)[mask], advantage, rows, count)
    expected = aggregate_by_hand(aggregation, terms, rows, count)
    expected.backward()
    expected_grads = {name: p.grad for name, p in model.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert metrics["loss_objective"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert set(got) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("verl", list(VERL_AGGREGATIONS))
def test_verl_names_are_refused_with_ours(verl):
    """A did-you-mean would suggest seq_mean_token_sum for verl's "seq-mean-token-mean"."""
    with pytest.raises(ConfigError) as err:
        tiny_config(loss={"aggregation": verl})
    assert str(err.value) == (
        f"tests: [loss] aggregation: {verl!r} is verl's name; here it is "
        f"{VERL_AGGREGATIONS[verl]!r}; allowed: 'token_mean', 'prompt_mean', "
        "'seq_mean_token_sum', 'seq_mean_token_sum_norm'"
    )
