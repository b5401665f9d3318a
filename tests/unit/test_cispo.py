"""`[loss] name = "cispo"` is MiniMax-M1's CISPO; GRPO and DAPO are still PPO-clipped.

The learner's loss values, clip fractions and gradients are checked against the algorithms'
definitions written out by hand on a transformers model (the learner's exported weights),
each row run unpadded, on behaviour log-probs that put tokens on both sides of both bounds
under both signs of advantage.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torchrl.objectives.llm import CISPOLoss

from tests.support.by_hand import (
    clipping_batch,
    response_log_probs,
    transformers_twin,
    update_with_gradients,
)
from tests.support.models import batches, loss_outputs_and_grads, tiny_config
from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.cispo import MiniMaxCISPOLoss

# [loss] table -> (the algorithm, its lower and upper clip epsilon; None: no lower bound)
CASES = {
    "cispo": ({"name": "cispo"}, "cispo", None, 0.2),
    # TorchRL's own forward (a KL term, here of weight 0) and TorchRL's dense log-probs
    "cispo torchrl forward": ({"name": "cispo", "kl_to_inference_coeff": 0.0}, "cispo", None, 0.2),
    "cispo dense": ({"name": "cispo", "dense": True}, "cispo", None, 0.2),
    "cispo clip_epsilon=0.28": ({"name": "cispo", "clip_epsilon": 0.28}, "cispo", None, 0.28),
    "cispo clip_epsilon=[0.2, 0.28]": (
        {"name": "cispo", "clip_epsilon": [0.2, 0.28]},
        "cispo",
        0.2,
        0.28,
    ),
    "grpo": ({"name": "grpo"}, "ppo", 0.2, 0.2),
    "dapo": ({"name": "dapo", "clip_epsilon": [0.2, 0.28]}, "ppo", 0.2, 0.28),
}


def learner(loss: dict) -> LocalLearner:
    """No entropy bonus and no gradient clipping: the objective alone makes the gradient.
    "dense": True scores with TorchRL's dense distribution instead of the chunked one."""
    loss = dict(loss)
    chunk = {"logprob_chunk_size": 0} if loss.pop("dense", False) else {}
    return LocalLearner(
        tiny_config(loss={"entropy_bonus": False, **loss}, learner={"clip_norm": 0.0, **chunk})
    )


def by_hand(algorithm: str, log_pi, log_mu, advantage, low: float | None, high: float):
    """The per-token loss terms and which tokens' weight the bounds changed.

    cispo (MiniMax-M1, eq. 4): -sg(clip(r, 1 - low, 1 + high)) * A * log pi, no lower bound
    when low is None; ppo (GRPO, DAPO): -min(r * A, clip(r, 1 - low, 1 + high) * A).
    """
    ratio = (log_pi - log_mu).exp()
    if algorithm == "cispo":
        weight = ratio.detach().clamp(None if low is None else 1 - low, 1 + high)
        return -weight * advantage * log_pi, weight != ratio.detach()
    clipped = ratio.clamp(1 - low, 1 + high)
    return -torch.minimum(ratio * advantage, clipped * advantage), clipped != ratio


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_are_the_algorithm_by_hand(case):
    loss, algorithm, low, high = CASES[case]
    trained = learner(loss)
    model = transformers_twin(trained)
    batch = clipping_batch(model)
    mask = batch.get(ASSISTANT_MASK_KEY)
    log_mu = batch.get(LOG_PROBS_KEY)[mask]
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)[mask]
    log_pi = response_log_probs(model, batch)
    terms, clipped = by_hand(algorithm, log_pi, log_mu, advantage, low, high)
    ratio = (log_pi - log_mu).exp().detach()
    sides = {
        (side, sign)
        for bound in (1 - (low or 0.2), 1 + high)
        for side, sign in zip((ratio > bound).tolist(), (advantage > 0).tolist(), strict=True)
    }
    assert len(sides) == 4, "the fixture needs tokens on both sides of each bound, A > 0 and < 0"
    terms.mean().backward()  # the token mean over the batch's response tokens
    expected = {name: p.grad for name, p in model.named_parameters()}

    metrics, got = update_with_gradients(trained, batch)

    assert metrics["loss_objective"] == pytest.approx(terms.mean().item(), rel=1e-5, abs=1e-7)
    assert 0 < clipped.float().mean() < 1
    assert metrics["clip_fraction"] == pytest.approx(float(clipped.float().mean()), abs=1e-6)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("loss", "gets_gradient"), [("cispo", True), ("grpo", False)])
def test_a_token_clipped_above_with_a_positive_advantage(loss, gets_gradient):
    """CISPO keeps its gradient, scaled by the bound 1 + eps_high; GRPO's min() takes the
    clipped, constant term, whose gradient is zero."""
    trained = learner({"name": loss})
    batch = batches(1, varied=True)[0]
    mask = batch.get(ASSISTANT_MASK_KEY)
    with torch.no_grad():
        log_pi = trained.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY).log_prob(
            batch.get(TOKENS_KEY)
        )
    batch.set(LOG_PROBS_KEY, torch.where(mask, log_pi - 1.0, torch.nan))  # r = e > 1.2
    batch.set(ADVANTAGE_KEY, batch.get(ADVANTAGE_KEY).abs() + 0.1)
    batch = check_batch(batch, trained.vocab_size, False)
    _, grads = loss_outputs_and_grads(trained, batch)

    by_hand = learner({"name": loss})
    log_pi = by_hand.policy.get_dist(batch, mask_key=ASSISTANT_MASK_KEY).log_prob(
        batch.get(TOKENS_KEY)
    )
    advantage = batch.get(ADVANTAGE_KEY).reshape(-1, 1).expand_as(mask)
    (-(1.2 * advantage * log_pi)[mask].mean()).backward()
    policy_gradient = [p.grad for p in by_hand.model.parameters() if p.grad is not None]

    assert len(grads) == len(policy_gradient) > 0
    if gets_gradient:
        for got, want in zip(grads, policy_gradient, strict=True):
            torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
    else:
        assert all(not g.any() for g in grads), "GRPO's clipped tokens carry no gradient"
        assert any(g.any() for g in policy_gradient)


THREE_TOKENS = torch.tensor([[0.0], [0.5], [-0.5]])  # log-ratios
THREE_ADVANTAGES = torch.tensor([[1.0], [1.0], [-1.0]])


def test_torchrl_cispo_still_drops_the_gradient_of_clipped_tokens():
    """The reproduction in `titan_learner.learner.loss.cispo`. When this fails, TorchRL changed
    CISPOLoss: if it now gives the paper's [-1, -1.28, 0.8], remove MiniMaxCISPOLoss; if the
    methods it overrides changed their signatures, adapt it."""
    overridden = {
        "_compute_policy_objective": ["self", "log_weight", "advantage"],
        "_get_cur_log_prob": ["self", "tensordict"],
    }
    for name, parameters in overridden.items():
        assert list(inspect.signature(getattr(CISPOLoss, name)).parameters) == parameters, name
    assert "clip_epsilon" in inspect.signature(CISPOLoss.__init__).parameters
    log_weight = THREE_TOKENS.clone().requires_grad_()
    objective, _ = CISPOLoss(clip_epsilon=(0.2, 0.28))._compute_policy_objective(
        log_weight, THREE_ADVANTAGES
    )
    (gradient,) = torch.autograd.grad(objective.sum(), log_weight)
    assert gradient.squeeze(-1).tolist() == [-1.0, 0.0, 0.0]


def test_the_three_tokens_get_the_paper_gradient():
    loss = MiniMaxCISPOLoss(clip_epsilon=(0.2, 0.28))
    log_weight = THREE_TOKENS.clone().requires_grad_()
    log_pi = THREE_TOKENS.squeeze(-1) - 2.0
    vars(loss)["current_log_prob"] = log_pi  # what its forward records
    objective, clip_fraction = loss._compute_policy_objective(log_weight, THREE_ADVANTAGES)
    (gradient,) = torch.autograd.grad(objective.sum(), log_weight)
    torch.testing.assert_close(gradient.squeeze(-1), torch.tensor([-1.0, -1.28, 0.8]))
    weights = torch.tensor([1.0, 1.28, 0.8])
    torch.testing.assert_close(objective.squeeze(-1), -weights * torch.tensor([1, 1, -1]) * log_pi)
    assert float(clip_fraction) == pytest.approx(2 / 3)
