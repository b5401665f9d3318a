"""A step's loss is the mean over all of its tokens (or rows), however it is split.

Rows here train 1 to 15 response tokens. One optimizer step over micro-batches of unequal sizes
must equal the one-process step on the whole batch, for each aggregation TorchRL's GRPO-family
losses offer, with the entropy bonus and the KL to a reference. (Splits over data-parallel
ranks: tests/integration/test_parity.py.)
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import batches, tiny_config, with_ref_log_probs
from titan_learner.config.loss_values import AGGREGATIONS
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    REF_LOG_PROBS_KEY,
    TOKENS_KEY,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.normalization import micro_batch_counts, step_counts

TOL = 1e-5
F32 = torch.float32
MAX_NEW_TOKENS = 16  # seq_mean_token_sum_norm's constant
LOSSES = {
    "token_mean": {},
    "prompt_mean": {"aggregation": "prompt_mean"},
    "seq_mean_token_sum": {"aggregation": "seq_mean_token_sum"},
    "seq_mean_token_sum_norm": {"aggregation": "seq_mean_token_sum_norm"},
    "gspo": {"name": "gspo"},
    "sequence mask correction": {
        "correction": {"level": "sequence", "mode": "mask", "low": 0.5, "high": 1.5}
    },
    "token_mean with KL": {"kl_to_ref_coeff": 0.1},
    "dapo": {"clip_epsilon": [0.2, 0.28]},
}


def varied_batch(loss: dict):
    batch = batches(1, varied=True)[0]
    return with_ref_log_probs(batch) if "kl_to_ref_coeff" in loss else batch


def learner(loss: dict, accumulate: int = 1) -> LocalLearner:
    name = "dapo" if "clip_epsilon" in loss else "grpo"
    return LocalLearner(
        tiny_config(
            loss={"name": name, **loss},
            learner={"clip_norm": 0.0, "grad_accum_steps": accumulate},
            rollout={"max_new_tokens": MAX_NEW_TOKENS},
        )
    )


def max_weight_difference(a: LocalLearner, b: LocalLearner) -> float:
    wa, wb = a.get_weights(dtype=F32), b.get_weights(dtype=F32)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa.keys())


def test_the_fixture_trains_different_numbers_of_tokens_per_row():
    tokens = batches(1, varied=True)[0].get(ASSISTANT_MASK_KEY).sum(1)
    assert tokens.min() == 1 and tokens.max() >= 10 * tokens.min()


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("cut", [1, 3, 6])
def test_accumulated_step_equals_the_whole_batch(name, cut):
    loss = LOSSES[name]
    batch = varied_batch(loss)
    whole = learner(loss)
    expected = whole.update(batch)
    split = learner(loss, accumulate=2)
    micros = [batch[:cut], batch[cut:]]
    counts = step_counts(micros)
    first = split.update(micros[0], step_counts=counts)
    got = split.update(micros[1], step_counts=counts)
    assert "grad_norm" not in first.keys() and "grad_norm" in got.keys()
    assert max_weight_difference(whole, split) < TOL
    for key in expected.keys():
        if key.startswith("loss") or key == "grad_norm":
            assert float(got[key]) == pytest.approx(float(expected[key]), abs=TOL), key


def by_hand_loss(one: LocalLearner, batch, aggregation: str) -> torch.Tensor:
    """GRPO's loss written out: per trained token, -min(r A, clip(r, 0.8, 1.2) A) minus 0.01
    times the entropy (r = pi / mu); token_mean: their sum over the count of trained tokens;
    prompt_mean: the mean over rows of each row's token mean; seq_mean_token_sum: the mean over
    rows of each row's token sum; seq_mean_token_sum_norm: their sum over rows x
    MAX_NEW_TOKENS."""
    dist = one.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
    mask = batch.get(ASSISTANT_MASK_KEY)
    current = torch.where(mask, dist.log_prob(batch.get(TOKENS_KEY)), 0.0)
    ratio = (current - torch.where(mask, batch.get(LOG_PROBS_KEY), 0.0)).exp()
    advantage = batch.get("advantage").reshape(-1, 1)
    objective = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
    per_token = torch.where(mask, objective - 0.01 * torch.where(mask, dist.entropy(), 0.0), 0.0)
    if aggregation == "token_mean":
        return per_token.sum() / mask.sum()
    if aggregation == "seq_mean_token_sum":
        return per_token.sum(1).mean()
    if aggregation == "seq_mean_token_sum_norm":
        return per_token.sum() / (mask.shape[0] * MAX_NEW_TOKENS)
    return (per_token.sum(1) / mask.sum(1)).mean()


def gradients_at_the_step(one: LocalLearner) -> dict[str, torch.Tensor]:
    """Filled with the gradients the optimizer steps with (no clipping), at its step."""
    grads: dict[str, torch.Tensor] = {}
    step = one.optimizer.step

    def record(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in one.model.named_parameters()})
        return step(*args, **kwargs)

    one.optimizer.step = record
    return grads


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_each_allowed_aggregation_is_exact_across_micro_batches(aggregation):
    """Three micro-batches of 9, 46 and 1 trained tokens (2, 5 and 1 rows): the step's loss
    and gradients are the formula over the whole step, not the mean of the micro-batches'."""
    batch = varied_batch({})
    micros = [batch[:2], batch[2:7], batch[7:]]
    assert [int(micro_batch_counts(m)["tokens"]) for m in micros] == [9, 46, 1]
    split = learner({"aggregation": aggregation}, accumulate=3)
    loss = by_hand_loss(split, batch, aggregation)
    loss.backward()
    expected = float(loss.detach())
    expected_grads = {n: p.grad.clone() for n, p in split.model.named_parameters()}
    split.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        mean_of_means = float(sum(by_hand_loss(split, m, aggregation) for m in micros) / 3)
    assert abs(mean_of_means - expected) > 0.1 * abs(expected)
    grads = gradients_at_the_step(split)
    counts = step_counts(micros)
    for micro in micros:
        metrics = split.update(micro, step_counts=counts)
    got = float(metrics["loss_objective"]) + float(metrics["loss_entropy"])
    assert got == pytest.approx(expected, abs=TOL)
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-4, msg=name)


def test_an_aggregation_the_normalization_does_not_know_is_refused():
    """No default weighting for a mode a future TorchRL (or a user's edit) adds: an error, at
    construction when the loss module is given, and at the update when it changed since."""
    message = (
        "GRPOLoss.aggregation = 'seq-mean-token-sum' has no normalization across micro-batches "
        "and ranks; allowed: 'token_mean', 'prompt_mean', 'seq_mean_token_sum', "
        "'seq_mean_token_sum_norm'"
    )
    one = learner({})
    one.loss_module.aggregation = "seq-mean-token-sum"
    with pytest.raises(ValueError) as err:
        LocalLearner(tiny_config(), loss_module=one.loss_module)
    assert str(err.value) == message
    before = one.get_weights(dtype=F32)
    with pytest.raises(ValueError) as err:
        one.update(varied_batch({}))
    assert str(err.value) == message
    after = one.get_weights(dtype=F32)
    assert all(torch.equal(before[k], after[k]) for k in before.keys())


def test_without_step_counts_each_micro_batch_is_normalized_alone():
    """The documented fallback: one micro-batch's mean each, equally weighted (lr 1e-3 steps
    the parameters whose gradient sign flips by 2e-3 against the whole batch's step)."""


@pytest.mark.parametrize("name", list(LOSSES))
def test_accumulation_without_step_counts_is_refused_before_any_compute(name):
    """The silent trap: each micro-batch averaged over its own tokens trains another objective."""
    loss = LOSSES[name]
    split = learner(loss, accumulate=2)
    before = split.get_weights(dtype=F32)
    averaged = f"aggregation {split.loss_module.aggregation}"
    with pytest.raises(ValueError) as info:
        split.update(varied_batch(loss)[:3])
    assert str(info.value) == (
        "update() without step_counts, with grad_accum_steps = 2 and a loss averaged over "
        f"counts ({averaged}), would average each micro-batch over its own tokens, not the "
        "step's; allowed: step_counts=step_counts(micro_batches) "
        "(titan_learner.step_counts) on every micro-batch of the window, "
        "[learner] max_tokens_per_microbatch, or per_microbatch_mean=True to train on "
        "per-micro-batch means"
    )
    assert split.step == 0 and split.stepper.micro_step == 0
    after = split.get_weights(dtype=F32)
    assert all(torch.equal(before[k], after[k]) for k in before.keys())


def test_per_microbatch_means_are_an_explicit_choice():
    """The opt-in: one micro-batch's mean each, equally weighted (lr 1e-3 steps the parameters
    whose gradient sign flips by 2e-3 against the whole batch's step); one micro-batch a
    window needs neither step_counts nor the opt-in."""
    batch = varied_batch({})
    whole, split = learner({}), learner({}, accumulate=2)
    whole.update(batch)
    for micro in (batch[:3], batch[3:]):
        split.update(micro, per_microbatch_mean=True)
    assert max_weight_difference(whole, split) > 1e-4
    single = learner({})
    single.update(batch)
    assert max_weight_difference(whole, single) == 0.0


def test_step_counts_must_describe_the_window():
    batch = varied_batch({})
    split = learner({}, accumulate=2)
    wrong = step_counts([batch[:3]])
    split.update(batch[:3], step_counts=wrong)
    with pytest.raises(ValueError, match=r"do not describe the micro-batches of this window"):
        split.update(batch[3:], step_counts=wrong)
    with pytest.raises(ValueError, match=r"step_counts must be a mapping with keys tokens, rows"):
        split.update(batch[:3], step_counts={"tokens": 3})


def test_counts_are_the_trained_tokens_rows_and_calls():
    batch = varied_batch({})
    counts = micro_batch_counts(batch)
    trained = batch.get(ASSISTANT_MASK_KEY) & torch.isfinite(batch.get(LOG_PROBS_KEY))
    assert counts == {"tokens": float(trained.sum()), "rows": 8.0, "calls": 1.0}
    assert step_counts([batch[:3], batch[3:]]) == {**counts, "calls": 2.0}


def test_kl_to_reference_is_a_mean_over_trained_tokens():
    """TorchRL averages the KL penalty over every padded position; ours over response tokens."""
    batch = varied_batch({"kl_to_ref_coeff": 0.1})
    one = learner({"kl_to_ref_coeff": 0.1})
    with torch.no_grad():
        dist = one.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
        current = dist.log_prob(batch.get(("tokens", "full")))
    mask = batch.get(ASSISTANT_MASK_KEY)
    diff = (batch.get(REF_LOG_PROBS_KEY) - current)[mask]
    expected = (diff.expm1() - diff).mean()
    metrics = one.update(batch)
    assert float(metrics["kl_to_ref"]) == pytest.approx(float(expected), rel=1e-4)
    assert float(metrics["loss_kl_to_ref"]) == pytest.approx(0.1 * float(expected), rel=1e-4)


def test_diagnostics_are_means_over_trained_tokens_not_padded_positions():
    """TorchRL averages clip_fraction, kl_approx and entropy over every padded position."""
    batch = varied_batch({})
    one = learner({})
    with torch.no_grad():
        dist = one.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY)
        current = dist.log_prob(batch.get(("tokens", "full")))
        entropy = dist.entropy()
    mask = batch.get(ASSISTANT_MASK_KEY)
    metrics = one.update(batch)
    kl = (batch.get(LOG_PROBS_KEY) - current)[mask].mean()
    assert float(metrics["kl_approx"]) == pytest.approx(float(kl), rel=1e-4)
    assert float(metrics["entropy"]) == pytest.approx(float(entropy[mask].mean()), rel=1e-4)
    log_ratio = (current - batch.get(LOG_PROBS_KEY))[mask]
    clipped = (log_ratio.exp() - 1).abs() > 0.2
    assert float(metrics["clip_fraction"]) == pytest.approx(float(clipped.float().mean()), abs=1e-6)


def test_step_counts_is_public_where_the_refusal_names_it():
    """update()'s refusal of accumulation without counts tells users to call
    titan_learner.step_counts: that name is the public API's (issue 61)."""
    import titan_learner
    from titan_learner.learner.loss import normalization

    assert titan_learner.step_counts is normalization.step_counts
    assert "step_counts" in titan_learner.__all__
