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
from transformers import AutoModelForCausalLM

from tests.support.models import batches, loss_outputs_and_grads, tiny_config
from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.cispo import MiniMaxCISPOLoss
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.export import iter_hf_tensors

F32 = torch.float32
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


def transformers_twin(trained: LocalLearner) -> torch.nn.Module:
    """A transformers model holding the learner's exported weights."""
    model = AutoModelForCausalLM.from_config(hf_config(trained.spec), dtype=F32).eval()
    model.load_state_dict(dict(trained.get_weights(dtype=F32).items()), strict=True)
    return model


def response_log_probs(model: torch.nn.Module, batch) -> torch.Tensor:
    """log pi of every response token, row by row (row-major, as `tensor[mask]` orders them),
    each row run through transformers without its padding."""
    rows = []
    for tokens, attention, response in zip(
        batch.get(TOKENS_KEY),
        batch.get(ATTENTION_MASK_KEY),
        batch.get(ASSISTANT_MASK_KEY),
        strict=True,
    ):
        real = tokens[attention]
        scores = model(real[None]).logits[0, :-1].log_softmax(-1)  # position j scores j + 1
        token_log_probs = scores.gather(-1, real[1:, None])[:, 0]
        rows.append(token_log_probs[response[attention][1:]])
    return torch.cat(rows)


def clipping_batch(model: torch.nn.Module):
    """A batch of rows of their own lengths whose behaviour log-probs are transformers' log pi
    shifted by -1 to +1, in an order mixing them over the rows: pi / mu runs from 0.37 to 2.7."""
    batch = batches(1, varied=True)[0]
    mask = batch.get(ASSISTANT_MASK_KEY)
    with torch.no_grad():
        log_pi = response_log_probs(model, batch)
    order = torch.randperm(len(log_pi), generator=torch.Generator().manual_seed(0))
    shift = torch.linspace(-1.0, 1.0, len(log_pi))[order]
    log_mu = torch.full(mask.shape, torch.nan)
    log_mu[mask] = log_pi - shift
    batch.set(LOG_PROBS_KEY, log_mu)
    return batch


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


def update_with_gradients(trained: LocalLearner, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    """One update's metrics, and its gradients (read at the optimizer step) under Hugging Face
    names: the export's adapter maps them as it maps the weights (it is linear: a split of the
    fused QKV and a permutation of the q/k rows)."""
    grads: dict[str, torch.Tensor] = {}
    step = trained.optimizer.step

    def read(*args, **kwargs):
        params = [p for p in trained.model.parameters() if p.grad is not None]
        weights = [p.data for p in params]
        for p in params:
            p.data = p.grad
        try:
            grads.update(
                (name, t.clone()) for name, t in iter_hf_tensors(trained.model, trained.spec)
            )
        finally:
            for p, weight in zip(params, weights, strict=True):
                p.data = weight
        return step(*args, **kwargs)

    trained.optimizer.step = read
    metrics = trained.update(batch)
    return {k: float(v) for k, v in metrics.items()}, grads


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
    """The reproduction in `titan_learner.learner.cispo`. When this fails, TorchRL changed
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
