"""Token-budget micro-batches: packed by length, trimmed, and the step unchanged.

Rows here hold 2 to 16 real tokens and train 1 to 15 of them. A budget splits one update into
micro-batches of at most N computed positions; the optimizer step must equal the unsplit
batch's, for each aggregation TorchRL's GRPO-family losses offer. (Over data-parallel ranks,
which must agree on the number of micro-batches: tests/integration/test_parity.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import SEQ_LEN, batches, tiny_config, with_ref_log_probs
from titan_learner.config.errors import ConfigError
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    PROMPT_TOKENS_KEY,
    TOKENS_KEY,
    BatchError,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.microbatch import pack, row_lengths, split_to, take
from titan_learner.learner.microbatch import token_budget_micro_batches as split

TOL = 1e-5
F32 = torch.float32
BUDGET = 2 * SEQ_LEN  # the longest rows go two at a time, short ones several
LOSSES = {
    "token_mean": {},
    "prompt_mean": {"aggregation": "prompt_mean"},
    "token_mean with KL": {"kl_to_ref_coeff": 0.1},
    "dapo": {"name": "dapo", "clip_epsilon": [0.2, 0.28]},
}


def one_rank(count: int) -> int:
    return count


def varied(seed: int = 0, rows: int = 8):
    return batches(1, batch_size=rows, seed=seed, varied=True)[0]


def learner(loss: dict, budget: int = 0, **learner_section) -> LocalLearner:
    loss = {"name": "grpo", **loss}
    section = {"clip_norm": 1.0, "max_tokens_per_microbatch": budget, **learner_section}
    return LocalLearner(tiny_config(loss=loss, learner=section))


def test_micro_batches_hold_every_row_once_within_the_budget_longest_first():
    batch = varied(rows=32)
    lengths = row_lengths(batch)
    groups = pack(lengths, BUDGET)
    assert sorted(torch.cat(groups).tolist()) == list(range(32))
    for group in groups:
        assert len(group) * int(lengths[group].max()) <= BUDGET
    widths = [int(lengths[g].max()) for g in groups]
    assert widths == sorted(widths, reverse=True)
    assert len(groups) < 32 / 2  # short rows share: fewer micro-batches than rows / 2


def test_trimming_cuts_only_columns_that_are_padding_in_every_row():
    batch = varied(rows=32)
    lengths = row_lengths(batch)
    micros = split(batch, BUDGET, one_rank)
    padded_before = 1 - float(lengths.sum()) / (32 * SEQ_LEN)
    computed = sum(m.get(TOKENS_KEY).numel() for m in micros)
    assert computed < 0.75 * 32 * SEQ_LEN and padded_before > 0.4
    for micro in micros:
        attention = micro.get(ATTENTION_MASK_KEY)
        assert attention[:, 0].any(), "a leading all-padding column was kept"
        for key in (TOKENS_KEY, ASSISTANT_MASK_KEY, LOG_PROBS_KEY):
            assert micro.get(key).shape == attention.shape
    real = sorted(
        tuple(row[mask].tolist())
        for m in micros
        for row, mask in zip(m.get(TOKENS_KEY), m.get(ATTENTION_MASK_KEY), strict=True)
    )
    whole = batch.get(TOKENS_KEY)
    assert real == sorted(
        tuple(r[m].tolist()) for r, m in zip(whole, batch.get(ATTENTION_MASK_KEY), strict=True)
    )


def test_a_right_padded_row_is_never_cut():
    batch = varied(rows=4)
    attention = batch.get(ATTENTION_MASK_KEY).clone()
    attention[0] = torch.arange(SEQ_LEN) < 5  # real tokens first, padding after
    batch.set(ATTENTION_MASK_KEY, attention)
    batch.set(ASSISTANT_MASK_KEY, batch.get(ASSISTANT_MASK_KEY) & attention)
    micro = take(batch, torch.tensor([0, 1]))
    assert micro.get(ATTENTION_MASK_KEY).shape[1] == SEQ_LEN
    assert torch.equal(micro.get(ATTENTION_MASK_KEY)[0], attention[0])


def test_ranks_that_pack_into_fewer_micro_batches_split_their_largest():
    lengths = torch.tensor([16, 16, 4, 4, 4, 4, 2, 2])
    groups = pack(lengths, BUDGET)
    assert [g.tolist() for g in groups] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    more = split_to(groups, lengths, 4)
    assert sorted(len(g) for g in more) == [1, 1, 3, 3]
    assert sorted(torch.cat(more).tolist()) == list(range(8))
    micros = split(varied(rows=8), BUDGET, lambda count: count + 3)
    assert len(micros) == len(pack(row_lengths(varied(rows=8)), BUDGET)) + 3


def test_too_few_rows_for_the_ranks_count_is_one_clear_error():
    with pytest.raises(BatchError) as err:
        split_to(pack(torch.tensor([16, 16]), BUDGET), torch.tensor([16, 16]), 3)
    assert str(err.value) == (
        "data-parallel ranks must run the same number of micro-batches (3, the most any rank "
        "needs), but this rank has 2 row(s); allowed: equal row counts on every rank, or a "
        "larger max_tokens_per_microbatch"
    )


def test_a_row_longer_than_the_budget_is_refused_before_any_compute():
    one = learner({}, budget=8)
    before = one.get_weights(dtype=F32)
    with pytest.raises(BatchError) as err:
        one.update(varied())
    assert str(err.value) == (
        "a row holds 16 real tokens, more than max_tokens_per_microbatch = 8; allowed: a "
        "budget of at least the longest prompt + completion"
    )
    after = one.get_weights(dtype=F32)
    assert all(torch.equal(before[k], after[k]) for k in before.keys())
    assert one.step == 0


def test_prompt_tokens_are_refused_with_a_budget():
    batch = varied()
    batch.set(PROMPT_TOKENS_KEY, batch.get(TOKENS_KEY)[:, :4])
    with pytest.raises(BatchError, match=r"not supported with max_tokens_per_microbatch"):
        learner({}, budget=BUDGET).update(batch)


def test_a_budget_with_gradient_accumulation_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        tiny_config(learner={"max_tokens_per_microbatch": 64, "grad_accum_steps": 2})
    assert str(err.value) == (
        "tests: [learner] max_tokens_per_microbatch: max_tokens_per_microbatch = 64 splits "
        "each step by tokens and grad_accum_steps = 2 by count; allowed: one of them "
        "(grad_accum_steps = 1 with a token budget)"
    )


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_budgeted_step_equals_the_whole_batch(name):
    loss = LOSSES[name]
    whole, budgeted = learner(loss), learner(loss, budget=BUDGET)
    for seed in range(2):  # the second step starts from moments the first one left
        batch = varied(seed)
        if "kl_to_ref_coeff" in loss:
            batch = with_ref_log_probs(batch)
        expected, got = whole.update(batch), budgeted.update(batch)
        assert set(got.keys()) == set(expected.keys())
        for key in expected.keys() - {"ESS"}:  # ESS: per micro-batch, token-weighted
            assert float(got[key]) == pytest.approx(float(expected[key]), abs=TOL), key
    assert budgeted.step == whole.step == 2
    assert budgeted.policy_version == 2
    wa, wb = whole.get_weights(dtype=F32), budgeted.get_weights(dtype=F32)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa.keys()) < TOL
    assert len(split(varied(0), BUDGET, one_rank)) > 1, "the budget must actually split"


def test_a_non_finite_micro_batch_drops_the_whole_step():
    """A NaN advantage in one micro-batch: no weight moves, and the next step is clean."""
    batch = varied()
    advantage = batch.get("advantage").clone()
    shortest = int(row_lengths(batch).argmin())  # packed into the last micro-batch
    advantage[shortest] = torch.nan
    batch.set("advantage", advantage)
    one = learner({}, budget=BUDGET)
    before = one.get_weights(dtype=F32)
    metrics = one.update(batch)
    after = one.get_weights(dtype=F32)
    assert int(metrics["skipped_nonfinite_steps"]) == 1 and "grad_norm" not in metrics.keys()
    assert all(torch.equal(before[k], after[k]) for k in before.keys())
    assert one.step == 1 and one.policy_version == 0
    whole = learner({})
    whole.load_state_dict(one.state_dict())
    expected, got = whole.update(varied(1)), one.update(varied(1))
    assert float(got["loss_objective"]) == pytest.approx(float(expected["loss_objective"]), abs=TOL)
