"""Log-probs and entropies of a batch that fits one lm_head chunk, scored in its justified layout.

`TitanPolicy.token_dist` runs the decoder on left-justified rows (real tokens first). The chunked
path (`titan_learner.learner.forward.logprobs.TokenScorer`) reads how many positions are scored and the
last justified position any of them takes (a host read, so that the decoder stops there), selects
their hidden states and scatters their scores back: some forty operators, most of a small model's
scoring time. A batch of at most `logprob_chunk_size` positions fits that one chunk whole, so
scoring every justified position costs no more memory than the chunk would, and needs neither the
host read nor the selections: the decoder runs on every justified position, each scores the
next justified token (the last one, the row's first: see `_JustifiedTokenStats`), and one gather
puts each score at its caller position. This is one autograd node (`_JustifiedTokenStats`), the
lm_head's matmul included where its weight is a plain tensor after the decoder's forward (see
`titan_learner.learner.forward.logprobs`); otherwise (a bias, autocast, a tensor-parallel DTensor) the
lm_head runs as `logprobs` runs it and the node starts from its logits.

Scoring every position also runs the lm_head on the positions no loss reads (prompts,
padding): where its matmul is the cost, that outweighs what the bookkeeping saved (a 21 M
parameter model, vocabulary 8192, 8 x 128 tokens, half of them scored: 1.16x the chunked path's
step). So a batch is scored whole only while its logits are small, `WHOLE_BATCH_LOGITS`, where
the overhead of an operator is what a step pays for (the 0.08 M benchmark model's 8 x 32
batch: ~1% of its step; see docs/performance.md).

The results are the chunked path's up to float32 rounding (the lm_head's matmul runs on other
rows, so its blocking may differ): 0 off the mask and at `ignore_index`, and the uniform
distribution's constants at a row's first real token, which no position precedes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from titan_learner.learner.forward.logprobs import (
    IGNORE_INDEX,
    _full_logits,
    _logits_grad,
    _matmul_weight,
    _stats_forward,
    used_grads,
)

WHOLE_BATCH_LOGITS = 2**20
"""The most logits (positions x vocabulary, 4 MiB in float32) of a batch scored whole."""


class _JustifiedTokenStats(torch.autograd.Function):
    """From the states (with the lm_head's plain weight) or the logits of the justified
    positions: the log-probs of `tokens` `[B, T]` and their entropies `[B, T]`, each at its
    caller position, 0 where `keep` is False.

    Justified position j predicts the token at j + 1. The last one predicts nothing, so its
    logits are set to zeros and it stands for the position before each row's first token: the
    shifted convention's uniform distribution (TorchRL's dense path scores those zeros too).
    Every caller position then reads exactly one predictor (the one before its justified
    position, cyclically), whose target is its own token: scores go back with one gather each,
    gradients come in with one. Only the targets of `keep` are read: a padding position's id
    may be anything (the batch check reads real tokens only).
    """

    @staticmethod
    def forward(
        ctx,
        inputs: torch.Tensor,
        weight: torch.Tensor | None,
        tokens: torch.Tensor,
        order: torch.Tensor,
        keep: torch.Tensor,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = inputs.reshape(-1, inputs.shape[-1])
        if weight is None:  # the logits themselves: a copy, as the last row is overwritten
            logits = rows.to(_scoring_dtype(rows.dtype), copy=True)
        else:
            logits = rows.mm(weight.t())
            logits = logits.to(_scoring_dtype(logits.dtype))
        shape = tokens.shape
        logits.view(*shape, -1).select(1, -1).zero_()  # the rows' first tokens' predictor
        following = order.roll(-1, 1)  # each predictor's target's caller position
        scored = (tokens * keep).gather(1, following).reshape(-1)
        targets, ignored = scored.clamp_min(0), scored == IGNORE_INDEX
        log_probs, token, entropy = _stats_forward(logits, targets, with_entropy, ignored)
        source = torch.argsort(following, dim=1)  # each caller position's predictor
        ctx.save_for_backward(rows, weight, log_probs, targets, entropy, ignored, keep, following)
        ctx.inputs_shape = inputs.shape
        ctx.set_materialize_grads(False)  # an entropy only measured passes None: no work
        token = torch.where(keep, token.view(shape).gather(1, source), 0.0)
        if entropy is not None:
            entropy = torch.where(keep, entropy.view(shape).gather(1, source), 0.0)
        return token, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx, token_grad: torch.Tensor | None, entropy_grad: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None, None]:
        rows, weight, log_probs, targets, entropy, ignored, keep, following = ctx.saved_tensors
        if token_grad is not None:
            token_grad = torch.where(keep, token_grad, 0.0).gather(1, following).view(-1)
        if entropy_grad is not None:
            entropy_grad = torch.where(keep, entropy_grad, 0.0).gather(1, following).view(-1)
        token_grad, entropy = used_grads(token_grad, entropy_grad, entropy, targets, log_probs)
        grad = _logits_grad(log_probs, targets, entropy, ignored, token_grad, entropy_grad)
        grad.view(*keep.shape, -1).select(1, -1).zero_()  # the constant predictor: none
        if weight is None:  # the node started from the logits
            return grad.view(ctx.inputs_shape), None, None, None, None, None
        grad = grad.to(weight.dtype)
        inputs_grad = grad.mm(weight).view(ctx.inputs_shape)
        return inputs_grad, grad.t().mm(rows), None, None, None, None


def _scoring_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float32 logits, as the chunked path scores them (float64 stays float64)."""
    return dtype if dtype == torch.float64 else torch.float32


def justified_token_stats(
    hidden: torch.Tensor,
    head: nn.Module,
    tokens: torch.Tensor,
    order: torch.Tensor,
    mask: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs of `tokens` `[B, T]` and, optionally, entropies `[B, T]`, 0 where `mask`
    is False, from `hidden` `[B, T, D]`: the decoder's final-norm states of the rows
    left-justified by `order`. The chunked path's values for a batch that fits one chunk (see
    the module docstring)."""
    weight = _matmul_weight(head, hidden)
    # without a plain weight, the lm_head runs as the chunked path runs it: the node starts
    # from its logits
    inputs = hidden if weight is not None else _full_logits(head, hidden.flatten(0, -2))
    return _JustifiedTokenStats.apply(inputs, weight, tokens, order, mask, with_entropy)
