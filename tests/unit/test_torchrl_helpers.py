"""The loss class's own `_log_weight`, `_get_entropy` and clip bounds give TorchRL's values.

`MaskedLogWeight`, `ChunkedEntropy` and `CachedClipBounds` stand in for TorchRL's helpers with
fewer operators and no host read: every output (loss terms and diagnostics) and every gradient
must equal TorchRL's own path bit for bit, on rows of their own lengths with a response token
whose behaviour log-prob is missing, with the KL terms on and off.
"""

from __future__ import annotations

import math

import pytest
import torch
from torchrl.objectives.llm.grpo import GRPOLoss

from tests.support.models import (
    batches,
    loss_outputs_and_grads,
    tiny_config,
    with_ref_log_probs,
)
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY, check_batch
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss import losses

HELPERS = (
    (losses.MaskedLogWeight, "_log_weight"),
    (losses.ChunkedEntropy, "_get_entropy"),
    (losses.CachedClipBounds, "_clip_bounds"),
)

LOSSES = {
    "grpo": {"name": "grpo", "entropy_coeff": 0.01},
    "dapo": {"name": "dapo", "entropy_coeff": 0.01},
    "cispo": {"name": "cispo", "entropy_coeff": 0.01},
    "grpo with KL terms": {
        "name": "grpo",
        "entropy_coeff": 0.01,
        "kl_to_ref_coeff": 0.1,
        "kl_to_inference_coeff": 0.05,
    },
}


def batch_with_a_missing_log_prob(with_ref: bool):
    """Varied rows; one response token of the first row has no behaviour log-prob (NaN), so
    the trained mask is narrower than the response mask."""
    batch = batches(1, varied=True)[0]
    response = batch.get(ASSISTANT_MASK_KEY)[0].nonzero()
    assert len(response) >= 2, "the fixture's first row must have two response tokens"
    log_probs = batch.get(LOG_PROBS_KEY).clone()
    log_probs[0, response[-1, 0]] = math.nan
    batch.set(LOG_PROBS_KEY, log_probs)
    return with_ref_log_probs(batch) if with_ref else batch


@pytest.mark.parametrize("loss", list(LOSSES))
def test_outputs_and_gradients_equal_torchrl_own_helpers(loss, monkeypatch):
    learner = LocalLearner(tiny_config(loss=LOSSES[loss]))
    needs_ref = "kl_to_ref_coeff" in LOSSES[loss]
    batch = check_batch(batch_with_a_missing_log_prob(needs_ref), learner.vocab_size, needs_ref)
    ours, our_grads = loss_outputs_and_grads(learner, batch)
    keys = set(batch.keys(include_nested=True))
    with monkeypatch.context() as patch:
        for cls, name in HELPERS:
            patch.delattr(cls, name)  # the class's next base: TorchRL's own
        loss_class = type(learner.loss_module)
        patch.setattr(loss_class, "forward", loss_class._torchrl_forward)
        theirs, their_grads = loss_outputs_and_grads(learner, batch)
    assert set(batch.keys(include_nested=True)) == keys  # the batch is left as it was
    assert set(ours) == set(theirs)
    assert "entropy" in ours and "ESS" in ours and "kl_approx" in ours
    assert not needs_ref or {"loss_kl_to_ref", "loss_kl_to_inference"} <= set(ours)
    for key in ours:
        if key == "ESS":  # summed without TorchRL's boolean index (losses.effective_sample_size)
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=0)
        else:
            assert torch.equal(ours[key], theirs[key]), key
    assert len(our_grads) == len(their_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads, strict=True))


def test_the_clip_bounds_follow_a_schedule_and_a_load():
    """Cached between forwards; written in place (a schedule) or loaded, they are new."""
    learner = LocalLearner(tiny_config(loss={"name": "grpo", "clip_epsilon": 0.2}))
    loss = learner.loss_module

    def torchrl_bounds() -> tuple[torch.Tensor, torch.Tensor]:
        return GRPOLoss._clip_bounds.fget(loss)

    first = loss._clip_bounds
    assert loss._clip_bounds is first  # no operator on the next forward
    assert all(torch.equal(a, b) for a, b in zip(first, torchrl_bounds(), strict=True))
    loss.clip_epsilon_high.fill_(0.3)  # what a TorchRL schedule of the buffer does
    assert torch.equal(loss._clip_bounds[1], torchrl_bounds()[1])
    assert torch.equal(loss._clip_bounds[1], torch.tensor(0.3).log1p())
    loss.load_state_dict({**loss.state_dict(), "clip_epsilon_low": torch.tensor(0.1)})
    assert torch.equal(loss._clip_bounds[0], torch.tensor(-0.1).log1p())
    assert all(torch.equal(a, b) for a, b in zip(loss._clip_bounds, torchrl_bounds(), strict=True))


def test_a_distribution_of_another_kind_takes_torchrl_entropy(monkeypatch):
    """Only the chunked distribution's entropy skips TorchRL's check (and its host read)."""
    learner = LocalLearner(tiny_config(learner={"logprob_chunk_size": 0}))  # the dense path
    calls = []
    own = GRPOLoss._get_entropy

    def counted(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(GRPOLoss, "_get_entropy", counted)
    batch = check_batch(batches(1, varied=True)[0], learner.vocab_size, False)
    learner.loss_module(batch)
    assert calls == [1]


@pytest.mark.parametrize(
    ("loss", "lean"), [("grpo", True), ("cispo", True), ("grpo with KL terms", False)]
)
def test_the_lean_forward_serves_the_learner_policy_and_falls_back_to_torchrl(
    loss, lean, monkeypatch
):
    """Without KL terms the learner's loss skips TorchRL's forward plumbing; with them it
    takes TorchRL's forward, as any other actor would. Either way `as_dict=True` gives the
    output's entries, in order, as a dict (its padded-position diagnostics as trained-token
    means), then the policy diagnostics and the log-prob mismatch."""
    learner = LocalLearner(tiny_config(loss=LOSSES[loss]))
    needs_ref = "kl_to_ref_coeff" in LOSSES[loss]
    batch = check_batch(batch_with_a_missing_log_prob(needs_ref), learner.vocab_size, needs_ref)
    loss_class, calls = type(learner.loss_module), []
    own = loss_class._torchrl_forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(loss_class, "_torchrl_forward", counted)
    with torch.no_grad():
        out = learner.loss_module(batch)
        entries = learner.loss_module(batch, as_dict=True)  # what the learner's update asks
    assert calls == ([] if lean else [1, 1])
    assert isinstance(out, loss_class.output_type) and type(entries) is dict
    diagnostics = ["clip_fraction_low", "clip_fraction_high"]
    assert list(entries) == [*out.keys(), *diagnostics, "logprob_mismatch", "logprob_mismatch_max"]
    log_probs = batch.get(LOG_PROBS_KEY)
    trained = batch.get(ASSISTANT_MASK_KEY) & log_probs.isfinite()
    positions_per_token = log_probs.numel() / trained.sum()
    for key in out.keys():
        scale = positions_per_token if key in losses.TOKEN_DIAGNOSTICS else 1.0
        torch.testing.assert_close(entries[key], out.get(key) * scale, msg=key)


def test_clip_fractions_by_side_on_a_hand_made_case():
    """eps 0.2: a ratio below 0.8 clips low, above 1.2 clips high; 0 (padding) neither."""
    learner = LocalLearner(tiny_config(loss={"name": "grpo", "clip_epsilon": 0.2}))
    ratios = torch.tensor([[0.5, 0.79, 0.81, 1.0], [1.19, 1.21, 3.0, 1.0]])
    out = {"entropy": torch.tensor(1.0)}  # with an entropy bonus: left as it is
    learner.loss_module.policy_diagnostics(out, ratios.log().unsqueeze(-1), None, None)
    assert out["clip_fraction_low"].item() == 2 / 8 and out["clip_fraction_high"].item() == 2 / 8
    assert out["entropy"].item() == 1.0


@pytest.mark.parametrize("loss", ["grpo", "grpo with KL terms"])
def test_entropy_and_clip_sides_are_metrics_without_an_entropy_bonus(loss):
    """The entropy a bonus would use, reported without one (and without its gradient); the
    two clip sides add up to TorchRL's clip_fraction."""
    batch = batch_with_a_missing_log_prob("kl_to_ref_coeff" in LOSSES[loss])
    metrics = {}
    for bonus in (True, False):
        config = tiny_config(loss={**LOSSES[loss], "entropy_bonus": bonus})
        metrics[bonus] = LocalLearner(config).update(batch)
    assert "loss_entropy" in metrics[True] and "loss_entropy" not in metrics[False]
    torch.testing.assert_close(metrics[False]["entropy"], metrics[True]["entropy"])
    for found in metrics.values():
        sides = found["clip_fraction_low"] + found["clip_fraction_high"]
        torch.testing.assert_close(sides, found["clip_fraction"])
    assert metrics[False]["clip_fraction"] > 0  # the behaviour log-probs are far off: it clips


@pytest.mark.parametrize("chunked", ["chunks", "whole batch", "shared prompts"])
def test_a_measured_entropy_leaves_the_gradients_bit_for_bit(chunked):
    """Without an entropy bonus the chunked pass computes the entropy for the metric only: its
    backward takes the entropy-free path, the gradients exactly those of a pass without it."""
    learner_section = {
        "chunks": {"logprob_chunk_size": 5},
        "whole batch": {},
        "shared prompts": {"share_prompts": True},
    }[chunked]
    config = tiny_config(loss={"name": "grpo", "entropy_bonus": False}, learner=learner_section)
    learner = LocalLearner(config)
    batch = check_batch(batch_with_a_missing_log_prob(False), learner.vocab_size, False)
    grads = {}
    for measured in (True, False):
        learner.policy.compute_entropy = measured
        _, grads[measured] = loss_outputs_and_grads(learner, batch)
    assert len(grads[True]) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))


def test_the_effective_sample_size_is_torchrl_without_its_boolean_index():
    """TorchRL's formula on the selected weights, also where exp() of them would overflow;
    NaN with no trained token, as TorchRL's, whatever count the caller passes."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 9, generator=generator) > 0.4
    for scale in (0.1, 60.0):  # exp(60 * 3) overflows float32: only relative weights work
        log_weight = torch.randn(6, 9, generator=generator) * scale
        chosen = log_weight[mask]
        torchrl = (2 * chosen.logsumexp(0) - (2 * chosen).logsumexp(0)).exp() / mask.sum()
        ours = losses.effective_sample_size(log_weight, mask)
        torch.testing.assert_close(ours, torchrl, rtol=1e-5, atol=0)
        assert torch.equal(losses.effective_sample_size(log_weight, mask, mask.sum()), ours)
    assert losses.effective_sample_size(log_weight, torch.zeros_like(mask)).isnan()
    one = torch.tensor(1)  # the loss's trained count is at least 1: still NaN
    assert losses.effective_sample_size(log_weight, torch.zeros_like(mask), one).isnan()
    assert losses.effective_sample_size(
        torch.zeros(0, 9), torch.zeros(0, 9, dtype=torch.bool)
    ).isnan()
