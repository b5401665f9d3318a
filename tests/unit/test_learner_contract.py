"""The Learner contract (DESIGN.md), checked on the one-process LocalLearner.

The contract lives in the shared `Learner` base, so what holds here holds for TitanLearner;
the sharded specifics (gradient sync, DTensor clipping) are covered by test_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torchrl.trainers.trainers import DefaultOptimizationStepper

from tests.support.models import GLOBAL_BATCH, SEQ_LEN, VOCAB, batches, tiny_config
from titan_learner.learner.batch import BatchError
from titan_learner.learner.forward.policy import TitanPolicy
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.normalization import step_counts


def weights(learner) -> dict[str, torch.Tensor]:
    return dict(learner.get_weights(dtype=torch.float32).items())


def assert_same_weights(a, b, atol=0.0):
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


class ScaledGRPO(nn.Module):
    """GRPO times a learnable coefficient: a loss-owned parameter that receives a gradient."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, batch):
        out = self.inner(batch).to_tensordict()
        out["loss_objective"] = out["loss_objective"] * self.scale
        return out


class PerSequenceLoss(nn.Module):
    """A loss that forgot to reduce: one value per sequence."""

    def __init__(self, policy: TitanPolicy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, batch):
        logits = self.policy.token_logits(
            batch["tokens", "full"], batch["masks", "all_attention_mask"]
        )
        return TensorDict({"loss": logits.logsumexp(-1).mean(-1)}, batch_size=[])


class PlainLoss(PerSequenceLoss):
    """A loss whose only key is exactly "loss" (a real key, not a prefix)."""

    def forward(self, batch):
        return TensorDict({"loss": super().forward(batch)["loss"].mean()}, batch_size=[])


@pytest.fixture(scope="module")
def config():
    return tiny_config()


def test_parameter_with_gradient_outside_optimizer_raises(config):
    """The "critic never trains" mistake: caught before the first optimizer step."""
    learner = LocalLearner(config)
    learner.loss_module = ScaledGRPO(learner.loss_module)
    before = weights(learner)
    with pytest.raises(
        RuntimeError,
        match=r"1 parameter\(s\) received gradients but are in no optimizer param group.*: scale\.",
    ):
        learner.update(batches(1)[0])
    assert_same_weights(weights(learner), before)


def test_a_loss_over_another_model_is_caught(config):
    """A loss built over some other policy would train nothing of this learner's."""
    other = LocalLearner(config)
    learner = LocalLearner(config, loss_module=other.loss_module)
    count = len(list(other.model.parameters()))
    with pytest.raises(RuntimeError, match=rf"{count} parameter\(s\) received gradients"):
        learner.update(batches(1)[0])


def test_non_scalar_loss_raises_a_clear_error(config):
    learner = LocalLearner(config)
    learner.loss_module = PerSequenceLoss(learner.policy)
    with pytest.raises(ValueError, match=r"shape \(8,\), not a scalar.*reduction"):
        learner.update(batches(1)[0])


def test_a_key_named_exactly_loss_is_trained(config):
    learner = LocalLearner(config)
    learner.loss_module = PlainLoss(learner.policy)
    before = weights(learner)
    metrics = learner.update(batches(1)[0])
    assert "grad_norm" in metrics.keys()
    assert not torch.equal(weights(learner)["model.norm.weight"], before["model.norm.weight"])


def test_non_finite_loss_drops_the_window_and_is_counted(config):
    learner = LocalLearner(config)
    before = weights(learner)
    poisoned = batches(1)[0]
    poisoned["advantage"] = torch.full_like(poisoned["advantage"], float("nan"))
    metrics = learner.update(poisoned)
    assert "grad_norm" not in metrics.keys()
    assert int(metrics["skipped_nonfinite_steps"]) == 1
    assert_same_weights(weights(learner), before)
    assert (learner.step, learner.policy_version) == (1, 0), "a window passed, weights did not"
    healthy = learner.update(batches(1)[0])
    assert "grad_norm" in healthy.keys() and (learner.step, learner.policy_version) == (2, 1)


def test_gradient_accumulation_over_halves_equals_one_full_batch(config):
    full = LocalLearner(config)
    accumulated = LocalLearner(tiny_config(learner={"grad_accum_steps": 2}))
    for batch in batches(2):
        reference = full.update(batch)
        half = GLOBAL_BATCH // 2
        counts = step_counts([batch[:half], batch[half:]])
        first = accumulated.update(batch[:half], step_counts=counts)
        second = accumulated.update(batch[half:], step_counts=counts)
        assert "grad_norm" not in first.keys() and "lr" not in first.keys()
        assert float(second["grad_norm"]) == pytest.approx(float(reference["grad_norm"]), abs=1e-6)
    assert_same_weights(weights(accumulated), weights(full), atol=1e-6)
    assert accumulated.step == full.step == 2


def test_checkpoint_round_trip_resumes_identically(config):
    learner = LocalLearner(config)
    data = batches(4)
    learner.update(data[0])
    state = learner.checkpoint()
    expected = [dict(learner.update(b).items()) for b in data[1:3]]
    expected_weights = weights(learner)

    learner.load_checkpoint(state)
    assert learner.step == 1
    resumed = [dict(learner.update(b).items()) for b in data[1:3]]
    for got, want in zip(resumed, expected, strict=True):
        for key in want:
            assert float(got[key]) == float(want[key]), key
    assert_same_weights(weights(learner), expected_weights)


def test_checkpoint_returns_clones_not_live_tensors(config):
    learner = LocalLearner(config)
    learner.update(batches(1)[0])
    state = learner.checkpoint()
    saved = state["model"]["norm.weight"].clone()
    learner.update(batches(2)[1])
    torch.testing.assert_close(state["model"]["norm.weight"], saved, atol=0, rtol=0)
    assert state["optimizer"], "optimizer moments are part of the checkpoint"


def test_an_uncloned_checkpoint_is_the_live_state(config):
    """clone=False (what a load fills in place) hands out the tensors the learner trains."""
    learner = LocalLearner(config)
    learner.update(batches(1)[0])
    live = learner.checkpoint(clone=False)
    moment = next(k for k in live["optimizer"] if k.endswith("norm.weight.exp_avg"))
    live["model"]["norm.weight"].add_(1.0)
    live["optimizer"][moment].zero_()
    state = learner.checkpoint()
    assert torch.equal(state["model"]["norm.weight"], live["model"]["norm.weight"])
    assert not state["optimizer"][moment].any()


def test_loading_a_mid_window_checkpoint_restarts_the_window(config):
    learner = LocalLearner(tiny_config(learner={"grad_accum_steps": 2}))
    batch = batches(1)[0]
    learner.update(batch[:4], step_counts=step_counts([batch[:4], batch[4:]]))
    state = learner.checkpoint()
    assert state["stepper"]["micro_step"] == 1
    with pytest.warns(UserWarning, match="window restarts"):
        learner.load_checkpoint(state)
    assert learner.stepper.micro_step == 0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.del_(("log_probs", "full")), r"missing \('log_probs', 'full'\)"),
        (
            lambda b: b.set(("tokens", "full"), b["tokens", "full"].float()),
            r"must be an integer tensor \[B, T\]",
        ),
        (
            lambda b: b.set(("tokens", "full"), b["tokens", "full"] + VOCAB),
            rf"token ids must lie in \[0, {VOCAB}\)",
        ),
        (
            lambda b: b.set("advantage", torch.zeros(GLOBAL_BATCH, 2)),
            r"'advantage' must be \[B\], \[B, 1\], \[B, 1, 1\] or \[B, T, 1\]",
        ),
        (
            lambda b: b.set(
                ("masks", "all_assistant_mask"), torch.ones(GLOBAL_BATCH, SEQ_LEN, dtype=torch.bool)
            ),
            r"marks padding positions",
        ),
    ],
    ids=["missing-key", "float-tokens", "token-out-of-vocab", "advantage-shape", "mask-on-padding"],
)
def test_bad_batches_fail_before_compute(config, mutate, message):
    learner = LocalLearner(config)
    before = weights(learner)
    batch = batches(1)[0]
    mutate(batch)
    with pytest.raises(BatchError, match=message):
        learner.update(batch)
    assert_same_weights(weights(learner), before)
    assert learner.stepper.micro_step == 0


def test_token_ids_are_checked_on_real_tokens_only_and_reported_exactly(config):
    learner = LocalLearner(config)
    batch = batches(1)[0]
    tokens, real = batch["tokens", "full"].clone(), batch["masks", "all_attention_mask"]
    tokens[~real] = 10**6  # padding ids are never read: any value passes
    batch["tokens", "full"] = tokens
    learner.update(batch)
    tokens[real.nonzero()[0].tolist()] = -3
    highest = int(tokens[real].max())
    with pytest.raises(BatchError) as raised:
        learner.update(batch)
    assert str(raised.value) == (
        f"token ids must lie in [0, {VOCAB}) (the model's vocab_size), got [-3, {highest}]"
    )


def test_per_sequence_advantage_shapes_are_accepted(config):
    a, b = LocalLearner(config), LocalLearner(config)
    batch = batches(1)[0]
    flat = batch.clone()
    flat["advantage"] = batch["advantage"].reshape(GLOBAL_BATCH)
    assert float(a.update(batch)["loss_objective"]) == float(b.update(flat)["loss_objective"])


def test_log_probs_do_not_depend_on_left_padding(config):
    policy = LocalLearner(config).policy
    generator = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, VOCAB, (1, 6), generator=generator)
    short = policy.token_logits(sequence, torch.ones(1, 6, dtype=torch.bool))
    padded_tokens = torch.cat([torch.zeros(1, 4, dtype=torch.long), sequence], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], 1)
    padded = policy.token_logits(padded_tokens, mask)
    torch.testing.assert_close(padded[:, 4:], short, atol=1e-5, rtol=0)


def test_any_torchrl_stepper_is_given_what_it_reads(config):
    learner = LocalLearner(config, stepper=DefaultOptimizationStepper())
    before = weights(learner)
    metrics = learner.update(batches(1)[0])
    assert "grad_norm" in metrics.keys()
    assert learner.step == 1
    assert not torch.equal(weights(learner)["model.norm.weight"], before["model.norm.weight"])


def test_a_non_stepper_is_rejected_at_construction(config):
    with pytest.raises(TypeError, match="stepper must be a torchrl OptimizationStepper"):
        LocalLearner(config, stepper=object())


@pytest.mark.parametrize(
    "loss",
    [{"name": "dapo", "clip_epsilon": [0.2, 0.28]}, {"name": "cispo"}],
    ids=["dapo", "cispo"],
)
def test_dapo_and_cispo_train(loss):
    learner = LocalLearner(tiny_config(loss=loss))
    metrics = learner.update(batches(1)[0])
    assert torch.isfinite(metrics["loss_objective"]) and learner.step == 1


def test_capabilities_are_frozen(config):
    caps = LocalLearner(config).capabilities
    with pytest.raises(AttributeError):
        caps.world_size = 2
    assert (caps.world_size, caps.sharded) == (1, False)


def test_checkpoint_of_a_fresh_learner_changes_nothing(config):
    """Reading optimizer state before the first step must not advance Adam's step count."""
    checkpointed, untouched = LocalLearner(config), LocalLearner(config)
    checkpointed.checkpoint()
    for batch in batches(2):
        checkpointed.update(batch)
        untouched.update(batch)
    assert_same_weights(weights(checkpointed), weights(untouched))


def test_loading_a_fresh_checkpoint_clears_trained_optimizer_state(config):
    """A checkpoint taken before any step holds empty Adam state; loading it must not keep the
    live learner's moments (the upstream "saved-empty entry is ignored" bug)."""
    fresh = LocalLearner(config)
    state = fresh.checkpoint()
    trained = LocalLearner(config)
    for batch in batches(2):
        trained.update(batch)
    trained.load_checkpoint(state)
    batch = batches(3)[2]
    assert float(trained.update(batch)["grad_norm"]) == float(fresh.update(batch)["grad_norm"])
    assert_same_weights(weights(trained), weights(fresh))


def test_clip_norm_zero_disables_clipping_but_reports_the_norm():
    clipped = LocalLearner(tiny_config(learner={"clip_norm": 1e-3}))
    unclipped = LocalLearner(tiny_config(learner={"clip_norm": 0.0}))
    batch = batches(1)[0]
    small, free = clipped.update(batch), unclipped.update(batch)
    assert float(free["grad_norm"]) == pytest.approx(float(small["grad_norm"]))
    assert float(free["grad_norm"]) > 1e-3
    moved = (weights(unclipped)["model.norm.weight"] - 1).abs().max()
    assert moved > (weights(clipped)["model.norm.weight"] - 1).abs().max()
