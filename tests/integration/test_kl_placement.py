"""`[kl] placement`: the KL to the reference in the loss (TorchRL's k3 term) or in the reward
(verl's `use_kl_in_reward`, k1 / k2 / k3), each equal to its formula written out by hand.

The reference's log-probs come from the learner's scoring (`with_reference_log_probs`, the
frozen `ReferenceModel` built from the config); the hand side scores each row unpadded with a
transformers model holding the reference's (initial) weights, and the policy's after training.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_train import short_run
from tests.support.by_hand import (
    F32,
    clipping_batch,
    response_log_probs,
    transformers_twin,
    update_with_gradients,
)
from tests.support.models import GROUP, batches, hf_model, tiny_config
from tests.support.worlds import run_world
from tests.unit.test_cispo import by_hand
from titan_learner.job.advantage import group_advantages
from titan_learner.job.kl_reward import K3_CLAMP, penalized
from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    check_batch,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.reference_scoring import with_reference_log_probs
from titan_learner.rollout.base import REWARD_KEY
from titan_learner.weights.export import iter_hf_tensors

COEFF = 0.1


def reference_twin(reference: ReferenceModel, learner: LocalLearner) -> torch.nn.Module:
    """A transformers model holding the reference's weights (its Hugging Face export)."""
    from transformers import AutoModelForCausalLM

    from titan_learner.model.hf_config import hf_config

    model = AutoModelForCausalLM.from_config(hf_config(learner.spec), dtype=F32).eval()
    weights = {k: v.float() for k, v in iter_hf_tensors(reference.model, learner.spec)}
    model.load_state_dict(weights, strict=True)
    return model


CONFIG = tiny_config(
    loss={"entropy_bonus": False, "kl_to_ref_coeff": COEFF}, learner={"clip_norm": 0.0}
)


def k_by_hand(estimator: str, log_pi: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) per token, r = log pi - log pi_ref."""
    r = log_pi - log_ref
    if estimator == "k1":
        return r
    if estimator == "k2":
        return r**2 / 2
    return (torch.exp(-r) - 1 + r).clamp(-K3_CLAMP, K3_CLAMP)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_loss_is_its_estimator_by_hand_values_and_gradients(estimator):
    """placement = "loss": loss_kl_to_ref = coeff x the mean over response tokens of the
    estimator (k3: TorchRL's exp(ref - pi) - (ref - pi) - 1; k1: pi - ref; k2: (pi - ref)^2 / 2),
    its gradient through pi (with the clipped objective's), on rows of varied length."""
    config = tiny_config(
        loss={"entropy_bonus": False, "kl_to_ref_coeff": COEFF},
        learner={"clip_norm": 0.0},
        kl={"estimator": estimator},
    )
    trained = LocalLearner(config)
    reference = ReferenceModel(config)
    for batch in batches(2, varied=True, seed=3):  # move the policy off the reference
        trained.update(with_reference_log_probs(batch, reference, 1))
    policy = transformers_twin(trained)
    ref_model = reference_twin(reference, trained)
    batch = with_reference_log_probs(clipping_batch(policy), reference, 2)
    mask = batch.get(ASSISTANT_MASK_KEY)
    log_mu = batch.get(LOG_PROBS_KEY)[mask]
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)[mask]
    log_pi = response_log_probs(policy, batch)
    with torch.no_grad():
        log_ref = response_log_probs(ref_model, batch)
    objective, _ = by_hand("ppo", log_pi, log_mu, advantage, 0.2, 0.2)
    kl = k_by_hand(estimator, log_pi, log_ref).mean()
    (objective.mean() + COEFF * kl).backward()
    expected = {name: p.grad for name, p in policy.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert abs(kl.item()) > 1e-4, "the policy moved: a KL to measure"
    assert metrics["kl_to_ref"] == pytest.approx(kl.item(), rel=1e-4)
    assert metrics["loss_kl_to_ref"] == pytest.approx(COEFF * kl.item(), rel=1e-4)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_reward_is_the_summed_estimator_before_the_group_advantage(estimator):
    """placement = "reward": reward_i - coeff x sum_t k(log mu_t - log ref_t), then
    A_i = (r'_i - mean_group) / (std_group + 1e-4); the behaviour log-probs mu are a
    transformers policy's, the reference's scored unpadded by transformers too."""
    config = tiny_config(
        loss={"entropy_bonus": False},
        learner={"clip_norm": 0.0},
        kl={"placement": "reward", "coeff": COEFF, "estimator": estimator},
    )
    reference = ReferenceModel(config)
    batch = batches(1, grouped=True, seed=5)[0]
    learner = LocalLearner(config)
    policy = hf_model(learner, seed=7)
    mask = batch.get(ASSISTANT_MASK_KEY)
    with torch.no_grad():
        log_mu = response_log_probs(policy, batch)
        log_ref = response_log_probs(reference_twin(reference, learner), batch)
    behaviour = torch.full(mask.shape, torch.nan)
    behaviour[mask] = log_mu
    batch.set(LOG_PROBS_KEY, behaviour)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.2])
    batch.set(REWARD_KEY, rewards)
    batch = check_batch(batch, 32, needs_ref_log_probs=False)

    scored = with_reference_log_probs(batch, reference, 2)
    out, penalty = penalized(scored, COEFF, estimator, lambda r: group_advantages(r, GROUP))

    per_token = k_by_hand(estimator, log_mu, log_ref)
    rows = mask.sum(1).tolist()
    want_penalty = COEFF * torch.stack([t.sum() for t in per_token.split(rows)])
    torch.testing.assert_close(penalty, want_penalty, atol=1e-5, rtol=1e-5)
    assert (want_penalty != 0).all() and want_penalty.abs().max() > 1e-2, "two models differ"
    shaped = (rewards - want_penalty).view(-1, GROUP)
    want = (shaped - shaped.mean(1, keepdim=True)) / (shaped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(
        out.get(ADVANTAGE_KEY).reshape(-1), want.reshape(-1), atol=1e-4, rtol=1e-4
    )
    assert torch.equal(out.get(REWARD_KEY), rewards), "the scored reward is kept as it was"

    # the step trains on the penalized advantages: GRPO's clipped objective with them, by hand
    twin = transformers_twin(learner)
    advantage = want.reshape(-1, 1).expand_as(mask)[mask]
    objective, _ = by_hand("ppo", response_log_probs(twin, out), log_mu, advantage, 0.2, 0.2)
    objective.mean().backward()
    expected = {name: p.grad for name, p in twin.named_parameters()}
    metrics, got = update_with_gradients(learner, out)
    assert metrics["loss_objective"] == pytest.approx(objective.mean().item(), rel=1e-4)
    assert any(grad.abs().max() > 0 for grad in expected.values()), "a gradient to compare"
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def kl_jobs(rank: int, root: str) -> dict[str, list[dict]]:
    reward_kl = ['kl.placement="reward"', "kl.coeff=0.05", 'kl.estimator="k3"']
    return {"reward": short_run(rank, f"{root}/reward", 2, [*reward_kl, "eval.every_steps=0"])}


@pytest.mark.slow
def test_the_job_logs_the_reward_kl(tmp_path):
    """Step 1 samples from the reference's own weights (KL ~ 0), step 2 from trained ones."""
    [runs] = run_world(1, kl_jobs, str(tmp_path))
    first, second = runs["reward"]
    assert abs(first["kl_reward_mean"]) < 1e-4
    assert second["kl_reward_mean"] > first["kl_reward_mean"] and second["kl_reward_mean"] > 0
    assert "kl_to_ref" not in first, "one KL: none in the loss"
