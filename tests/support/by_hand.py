"""The pieces of a by-hand check: a loss's values and gradients against its paper's formula,
written out in the test on log-probs of a transformers model run on each row unpadded."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from tests.support.models import batches
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.export import iter_hf_tensors

F32 = torch.float32


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


def token_rows(batch) -> torch.Tensor:
    """The row of each response token, in the order `response_log_probs` gives them."""
    return batch.get(ASSISTANT_MASK_KEY).nonzero()[:, 0]


def row_means(values: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """Each row's mean of `values` (one per response token, rows as `token_rows`)."""
    sums = torch.zeros(count, dtype=values.dtype).index_add(0, rows, values)
    return sums / torch.bincount(rows, minlength=count).to(values.dtype)
