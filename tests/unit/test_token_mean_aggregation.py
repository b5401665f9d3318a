"""`TokenMeanAggregation`: the learner's token mean of a loss term is TorchRL's, bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from torchrl.objectives.llm.grpo import GRPOLoss

from tests.support.models import batches, loss_outputs_and_grads, tiny_config
from titan_learner.learner.batch import check_batch
from titan_learner.learner.local import LocalLearner


def loss_terms(learner: LocalLearner, batch, torchrl_own: bool) -> tuple[dict, list]:
    """The loss output and the gradients of its summed loss terms, through the learner's
    aggregation or (torchrl_own) TorchRL's `GRPOLoss._aggregate_loss_value` itself."""
    loss = learner.loss_module
    if torchrl_own:
        loss._aggregate_loss_value = functools.partial(GRPOLoss._aggregate_loss_value, loss)
    try:
        out, grads = loss_outputs_and_grads(learner, check_batch(batch, learner.vocab_size, False))
    finally:
        loss.__dict__.pop("_aggregate_loss_value", None)
    return {k: v for k, v in out.items() if k.startswith("loss")}, grads


def count_torchrl_calls(monkeypatch) -> list:
    """Each call of TorchRL's own aggregation, appended to the returned list."""
    calls, own = [], GRPOLoss._aggregate_loss_value

    def counted(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(GRPOLoss, "_aggregate_loss_value", counted)
    return calls


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
def test_terms_and_gradients_equal_torchrl_bit_for_bit(loss, monkeypatch):
    """Rows of their own lengths (varied=True): the mean over all of the batch's tokens."""
    learner = LocalLearner(tiny_config(loss={"name": loss, "entropy_coeff": 0.01}))
    batch = batches(1, varied=True)[0]
    calls = count_torchrl_calls(monkeypatch)
    ours, our_grads = loss_terms(learner, batch, torchrl_own=False)
    assert not calls, "the learner's aggregation must not fall back here"
    theirs, their_grads = loss_terms(learner, batch, torchrl_own=True)
    assert set(ours) == {"loss_objective", "loss_entropy"} == set(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert len(our_grads) == len(their_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads, strict=True))


def test_a_loss_mask_in_the_batch_takes_torchrl_path(monkeypatch):
    """TorchRL also masks with a batch's ("collector", "mask"): that case is TorchRL's own."""
    learner = LocalLearner(tiny_config())
    calls = count_torchrl_calls(monkeypatch)
    batch = batches(1, varied=True)[0]
    keep = torch.ones(batch.batch_size[0], batch.get(("tokens", "full")).shape[1], 1).bool()
    keep[0] = False  # the first row's tokens drop out of the mean
    batch.set(("collector", "mask"), keep)
    ours, _ = loss_terms(learner, batch, torchrl_own=False)
    assert len(calls) == 2, "both loss terms through TorchRL's own aggregation"
    theirs, _ = loss_terms(learner, batch, torchrl_own=True)
    without, _ = loss_terms(learner, batch.exclude(("collector", "mask")), torchrl_own=False)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert not torch.equal(ours["loss_objective"], without["loss_objective"])


def test_the_loss_class_keeps_torchrl_forward_wrapped_once():
    """TorchRL's metaclass wraps each new loss class's forward: ours is `LeanForward`'s
    unwrapped, and its fallback the class's own, wrapped once."""
    from titan_learner.learner.loss.classes import titan_loss_class
    from titan_learner.learner.loss.losses import LeanForward

    assert titan_loss_class(GRPOLoss).forward is LeanForward.forward
    assert titan_loss_class(GRPOLoss)._torchrl_forward is GRPOLoss.forward
    assert not hasattr(GRPOLoss.forward.__wrapped__, "__wrapped__")
