"""Token log-probs and entropies from hidden states, one lm_head chunk at a time.

The dense path materializes float32 logits `[B, T, V]` (2.5 GB for 4k tokens of a 152k
vocabulary, several times over once log-softmax, entropy and their gradients are counted). Here
only the positions the loss scores are kept, as hidden states `[N, D]`, and the lm_head runs on
`chunk_size` of them at a time under activation checkpointing: forward keeps two floats per
position (the token's log-prob and the entropy), and backward recomputes one chunk's logits at a
time. Peak memory is a few `[chunk, V]` float32 buffers, whatever B * T is, plus the lm_head
weight gradient (each chunk's part is allocated, then added into the accumulated one).

Where the lm_head's weight is a plain tensor when the chunks run (FSDP has kept it unsharded
since the decoder's forward: TorchTitan does not reshard its last group after forward), each
chunk is a plain matmul with it: called as a module after the decoder's forward, the lm_head
would open a second FSDP pass of its group every step (the root's pre-forward again, a second
post-backward hook, a second gradient reduce-scatter). The gradient reaches the unsharded
weight, which the decoder's pass reduces once, after the final norm's backward. Otherwise
(resharded after forward, or tensor-parallel: a DTensor) the lm_head is called as a module, so
its hooks gather the weight; under tensor parallelism each chunk's vocab-sharded logits are
gathered whole. Precision: with float32 weights the chunks' weight
gradients are summed in float32 (also under autocast, see `_uncached_autocast`); with bf16
parameters (FSDP param_dtype) they are summed in bf16, so fewer, larger chunks are more exact.

`ChunkedTokenCategorical` is the distribution TorchRL's GRPO-family losses receive: it answers
what they call (`log_prob`, `mask`, `entropy`, and `sample` for the Monte-Carlo entropy fallback)
with the semantics of TorchRL's `LLMMaskedCategorical` over a position-level mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import distributions as D
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]
"""Hidden states `[n, D]` to logits `[n, V]` (the model's lm_head; a vocab-sharded DTensor
under tensor parallelism)."""

IGNORE_INDEX = -100


def _uncached_autocast(device_type: str) -> AbstractContextManager:
    """Under autocast, cast the lm_head weight afresh for this chunk instead of reusing a cast.

    Autocast caches one low-precision copy of each weight per autocast region, so every chunk
    would feed its weight gradient into that one copy and the chunks' parts would be summed in
    bf16. A fresh cast per chunk hands each part back to the float32 weight, summed in float32
    like the dense path's single matmul.
    """
    if not torch.is_autocast_enabled(device_type):
        return nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def _plain_weight(head: Head) -> torch.Tensor | None:
    """The lm_head's weight if one plain matmul can stand for calling it (see the module
    docstring): an `nn.Linear` (TorchTitan's, FSDP's wrapper of it) with Linear's own forward,
    whose weight is not a DTensor now."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None
    weight = head.weight
    return None if isinstance(weight, DTensor) else weight


def _matmul_weight(head: Head, hidden: torch.Tensor) -> torch.Tensor | None:
    """The lm_head's weight where one matmul of `hidden` with it inside an autograd node gives
    the logits: a plain weight (`_plain_weight`), no bias, `hidden` in its dtype and no
    autocast (whose casts the node would skip); None otherwise."""
    weight = _plain_weight(head)
    if (
        weight is None
        or head.bias is not None  # type: ignore[union-attr]
        or hidden.dtype != weight.dtype
        or torch.is_autocast_enabled(hidden.device.type)
    ):
        return None
    return weight


def _full_logits(head: Head, hidden: torch.Tensor) -> torch.Tensor:
    """One chunk of float32 logits; a vocab-sharded (tensor-parallel) chunk is gathered whole.

    Gathering per chunk moves the same bytes as the dense path's `full_tensor()` but holds one
    chunk, and keeps the log-softmax exact without a vocab-parallel reduction.
    """
    weight = _plain_weight(head)
    with _uncached_autocast(hidden.device.type):
        if weight is None:
            logits = head(hidden)
        else:  # as FSDP's pre-forward would: inputs in the parameters' dtype
            logits = F.linear(hidden.to(weight.dtype), weight, head.bias)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits.float()


def _stats_forward(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, ignored: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The log-softmax of `logits` `[n, V]`, the log-probs of `targets` `[n]` or `[n, S]` (0
    where `ignored`) and, optionally, the entropy `[n]`: what both autograd functions below
    compute and keep for backward."""
    log_probs = logits.log_softmax(-1)
    one = targets.dim() < logits.dim()  # one target a position, given as [n]
    token = log_probs.gather(-1, targets.unsqueeze(-1) if one else targets)
    if one:
        token = token.squeeze(-1)
    if ignored is not None:
        token.masked_fill_(ignored, 0.0)
    entropy = log_probs.exp().mul_(log_probs).sum(-1).neg_() if with_entropy else None
    return log_probs, token, entropy


def used_grads(
    token_grad: torch.Tensor | None,
    entropy_grad: torch.Tensor | None,
    entropy: torch.Tensor | None,
    targets: torch.Tensor,
    log_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs' gradient (zeros where the loss did not use them) and the entropy to
    differentiate: None where the loss did not use it (a metric), so `_logits_grad` skips its
    term, which would add zero, bit for bit."""
    if token_grad is None:
        token_grad = log_probs.new_zeros(targets.shape)
    return token_grad, entropy if entropy_grad is not None else None


def _logits_grad(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    entropy: torch.Tensor | None,
    ignored: torch.Tensor | None,
    token_grad: torch.Tensor,
    entropy_grad: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of the logits `[n, V]` from those of the log-probs and entropies, in two
    `[n, V]` buffers (see `_TokenStats`)."""
    if ignored is not None:
        token_grad = token_grad.masked_fill(ignored, 0.0)
    if targets.dim() < log_probs.dim():
        targets, token_grad = targets.unsqueeze(-1), token_grad.unsqueeze(-1)
    probs = log_probs.exp()
    # each target's onehot(y) - p, summed (one target per position: nothing to sum)
    weight = token_grad if token_grad.shape[-1] == 1 else token_grad.sum(-1, keepdim=True)
    if entropy is None:
        grad = probs.mul_(weight).neg_()
    else:
        grad = log_probs + entropy.unsqueeze(-1)
        grad.mul_(entropy_grad.unsqueeze(-1)).add_(weight).mul_(probs).neg_()
    return grad.scatter_add_(-1, targets, token_grad)


class _TokenStats(torch.autograd.Function):
    """Log-probs of `targets` `[n]` or `[n, S]` (token ids, one or S a position) and the entropy
    `[n]` from one chunk's logits `[n, V]`.

    Written as `log_softmax`, `gather`, `exp`, a product and a sum, autograd keeps two `[n, V]`
    tensors for backward (the log-probs and their exponent) and makes one more per operator in
    backward. Here backward keeps the log-probs alone and builds the logits' gradient in two
    `[n, V]` buffers, from d log p(y) / dz = onehot(y) - p and dH / dz = -p * (log p + H):
    with a large vocabulary that is most of the lm_head's memory and traffic.

    `ignored` (bool, shaped like `targets`): log-probs that are 0 and pass no gradient (a
    target at `ignore_index`), set here rather than by a `where` after it, and a `[n]` target
    gives a `[n]` log-prob without a squeeze after it: each would be one more autograd node.
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        with_entropy: bool,
        ignored: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_probs, token, entropy = _stats_forward(logits, targets, with_entropy, ignored)
        ctx.save_for_backward(log_probs, targets, entropy, ignored)
        ctx.set_materialize_grads(False)  # an entropy only measured passes None: no work
        return token, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx, token_grad: torch.Tensor | None, entropy_grad: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        log_probs, targets, entropy, ignored = ctx.saved_tensors
        token_grad, entropy = used_grads(token_grad, entropy_grad, entropy, targets, log_probs)
        grad = _logits_grad(log_probs, targets, entropy, ignored, token_grad, entropy_grad)
        return grad, None, None, None


class _ScatteredTokenStats(torch.autograd.Function):
    """`_TokenStats` of one chunk with the lm_head's plain weight before it and the scatter of
    both results into the `[B, T]` batch after it, as one autograd node.

    Composed, they are the matmul with the transposed weight, the statistics, and for each
    result a zero-filled index copy and a view: seven nodes whose bookkeeping costs more than
    their arithmetic on a small model. Backward repeats autograd's operations in its order
    (the weight's gradient as `grad.t().mm(rows)`, as autograd's matmul backward computes it
    for the column-major transposed weight), so values and gradients are the composition's bit
    for bit.
    """

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignored: torch.Tensor,
        positions: torch.Tensor,
        shape: torch.Size,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = rows.mm(weight.t()).float()
        log_probs, token, entropy = _stats_forward(logits, targets, with_entropy, ignored)
        ctx.save_for_backward(rows, weight, log_probs, targets, entropy, ignored, positions)
        ctx.set_materialize_grads(False)  # an entropy only measured passes None: no work
        scattered_entropy = None if entropy is None else _scattered(entropy, positions, shape)
        return _scattered(token, positions, shape), scattered_entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx, token_grad: torch.Tensor | None, entropy_grad: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None, None]:
        rows, weight, log_probs, targets, entropy, ignored, positions = ctx.saved_tensors
        if token_grad is not None:
            token_grad = token_grad.reshape(-1).index_select(0, positions)
        if entropy_grad is not None:
            entropy_grad = entropy_grad.reshape(-1).index_select(0, positions)
        token_grad, entropy = used_grads(token_grad, entropy_grad, entropy, targets, log_probs)
        grad = _logits_grad(log_probs, targets, entropy, ignored, token_grad, entropy_grad)
        grad = grad.to(weight.dtype)
        return grad.mm(weight), grad.t().mm(rows), None, None, None, None, None


def _scattered(values: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Values `[*S, N]` of the flat `positions` into `[*S, *shape]`, zeros elsewhere."""
    lead = values.shape[:-1]
    flat = values.new_zeros(*lead, math.prod(shape))
    return flat.index_copy(-1, positions, values).view(*lead, *shape)


def _chunk_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    with_entropy: bool,
    ignored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` `[n]` or `[n, S]` and, optionally, the entropy `[n]` of one
    chunk."""
    return _TokenStats.apply(_full_logits(head, hidden), targets, with_entropy, ignored)


def chunked_token_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    chunk_size: int,
    with_entropy: bool,
    ignored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs `[N]` or `[N, S]` of `targets` (shaped so) and entropies `[N]` from
    `hidden` `[N, D]`; 0 where `ignored` (bool, shaped like `targets`), without gradient.

    Each chunk is checkpointed (non-reentrant), so autograd saves only its inputs and the
    outputs: backward recomputes that chunk's logits alone. With N = 0 one empty chunk still
    runs, so the result stays connected to the graph (the loss can still call backward).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[0] <= chunk_size:
        # Most steps of a small batch: one chunk, which holds what the forward would keep
        # anyway (recomputing it would only cost time); no slice, no copy, no extra node.
        return _chunk_stats(hidden, targets, head, with_entropy, ignored)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    tokens, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        stop = start + chunk_size
        part = None if ignored is None else ignored[start:stop]
        args = (hidden[start:stop], targets[start:stop], head, with_entropy, part)
        if recompute:
            token, entropy = checkpoint(
                _chunk_stats, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            token, entropy = _chunk_stats(*args)
        tokens.append(token)
        entropies.append(entropy)
    token = torch.cat(tokens)
    return token, torch.cat(entropies) if with_entropy else None


@dataclass
class TokenScorer:
    """Scores the masked positions of a `[B, T]` batch from the hidden states that predict them.

    `hidden[i]` is the decoder output one position before the i-th masked position, whose
    index in the flattened `[B * T]` batch is `positions[i]` (row-major over the mask).
    Positions with `unscored[i]` are first in their sequence: the shifted convention gives them
    all-zero logits, i.e. a uniform distribution, which is reproduced here as constants so the
    results equal the dense path's. `unscored` is None when no position is (the usual case: a
    response follows its prompt), which spares the selections.
    """

    hidden: torch.Tensor
    unscored: torch.Tensor | None
    positions: torch.Tensor
    head: Head
    vocab_size: int
    chunk_size: int

    def stats(
        self, targets: torch.Tensor, with_entropy: bool, ignored: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs `[N]` or `[N, S]` of `targets` (shaped so) and entropies `[N]` (None if not
        asked); the log-probs are 0 where `ignored` (bool, shaped like `targets`)."""
        token, entropy = chunked_token_stats(
            self.hidden, targets, self.head, self.chunk_size, with_entropy, ignored
        )
        if self.unscored is None:
            return token, entropy
        uniform = math.log(self.vocab_size)
        unscored = self.unscored if token.dim() == 1 else self.unscored.unsqueeze(-1)
        if ignored is not None:  # an ignored target's log-prob stays 0
            unscored = unscored & ~ignored
        token = torch.where(unscored, -uniform, token)
        if entropy is not None:
            entropy = torch.where(self.unscored, uniform, entropy)
        return token, entropy

    def scattered_stats(
        self,
        targets: torch.Tensor,
        with_entropy: bool,
        ignored: torch.Tensor,
        shape: torch.Size,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`stats` of one target a position (`[N]`), scattered into the flat `[B, T]` `shape`
        as one autograd node (`_ScatteredTokenStats`); None where that does not apply: more
        than one chunk, a position without a state before it, an lm_head that is not one plain
        matmul now (a module with hooks to run, a DTensor, a bias), or autocast (its casts)."""
        weight = _matmul_weight(self.head, self.hidden)
        if weight is None or self.unscored is not None or self.hidden.shape[0] > self.chunk_size:
            return None
        return _ScatteredTokenStats.apply(
            self.hidden, weight, targets, ignored, self.positions, shape, with_entropy
        )

    @torch.no_grad()
    def sample(self, sample_shape: torch.Size) -> torch.Tensor:
        """Token ids `[*sample_shape, N]` drawn chunk by chunk (no logits kept, no gradient)."""
        draws = []
        for start in range(0, self.hidden.shape[0], self.chunk_size):
            logits = _full_logits(self.head, self.hidden[start : start + self.chunk_size])
            logits = torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4)
            draws.append(D.Categorical(logits=logits).sample(sample_shape))
        shape = (*sample_shape, self.hidden.shape[0])
        if not draws:
            return torch.zeros(shape, dtype=torch.long, device=self.hidden.device)
        drawn = torch.cat(draws, dim=-1)
        if self.unscored is None:
            return drawn
        uniform = torch.randint_like(drawn, self.vocab_size)
        return torch.where(self.unscored, uniform, drawn)


class ChunkedTokenCategorical(D.Distribution):
    """`LLMMaskedCategorical` over a position-level mask, without `[B, T, V]` logits.

    The log-probs of the scored `tokens` (and their entropies, when `with_entropy`) are computed
    once at construction, chunk by chunk. What TorchRL's GRPO, DAPO and CISPO losses use:

    - `log_prob(tokens)`: the precomputed log-probs, 0 where the mask is False or the value is
      `ignore_index` (as `LLMMaskedCategorical`). Other values are scored by a new chunked pass.
    - `mask`: the `[B, T]` position mask, read by the loss to build its token mask.
    - `entropy()`: per-position entropy, 0 where the mask is False (as the dense distribution,
      whose masked rows are constant); computed by a second chunked pass if not precomputed.
    - `sample()` / `rsample()`: only reached by the losses' Monte-Carlo entropy fallback (a
      non-finite entropy); drawn chunk by chunk, `ignore_index` where the mask is False.

    `logits`, `probs` and `mode` would need the full logits and are not provided.
    """

    arg_constraints: dict = {}  # noqa: RUF012 (torch.distributions' class-level contract)
    _position_level_masking = True

    def __init__(
        self,
        scorer: TokenScorer | Callable[[], TokenScorer],
        tokens: torch.Tensor,
        mask: torch.Tensor,
        *,
        with_entropy: bool = True,
        ignore_index: int = IGNORE_INDEX,
        stats: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`stats`: the log-probs of `tokens` and their entropies (None: not computed), both
        `[B, T]` and computed already (a batch scored whole, titan_learner.learner.
        justified_stats); `scorer` may then be a function that builds the `TokenScorer`, called
        only when another value is scored, the entropy computed, or a sample drawn, and
        `vocab_size` is the vocabulary's size."""
        if tokens.shape != mask.shape or mask.dtype != torch.bool:
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and a bool mask of the same shape are required, "
                f"got mask {mask.dtype} {tuple(mask.shape)}"
            )
        self._scorer_source = scorer
        self._tokens = tokens
        self._mask = mask
        self.ignore_index = ignore_index
        if stats is None:
            stats = self._score_tokens(with_entropy)
        self._log_probs, self._entropy = stats
        super().__init__(
            batch_shape=mask.shape,
            event_shape=torch.Size([vocab_size or self._scorer.vocab_size]),
            validate_args=False,
        )

    @property
    def _scorer(self) -> TokenScorer:
        """The scorer, built on first use when the distribution was given a function for it."""
        if not isinstance(self._scorer_source, TokenScorer):
            self._scorer_source = self._scorer_source()
        return self._scorer_source

    def _score_tokens(self, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The log-probs of `tokens` themselves, as `log_prob(tokens)` returns them (0 at
        ignore_index as well as off the mask), and their entropies, both `[B, T]`."""
        scorer = self._scorer
        scored = self._tokens.reshape(-1).index_select(0, scorer.positions)
        targets, ignored = scored.clamp_min(0), scored == self.ignore_index
        scattered = scorer.scattered_stats(targets, with_entropy, ignored, self._mask.shape)
        if scattered is None:
            token, entropy = scorer.stats(targets, with_entropy, ignored)
            scattered = self._scatter(token), None if entropy is None else self._scatter(entropy)
        return scattered

    def _scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Values `[*S, N]` of the masked positions into `[*S, B, T]`, zeros elsewhere."""
        return _scattered(values, self._scorer.positions, self._mask.shape)

    @property
    def mask(self) -> torch.Tensor:
        """The `[B, T]` position mask: True where a position is scored."""
        return self._mask

    @property
    def position_level_masking(self) -> bool:
        return True

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probs of `value` `[*S, B, T]`: 0 off the mask and at `ignore_index`."""
        if value is self._tokens:  # what TorchRL's losses pass: no comparison, no host sync
            return self._log_probs
        keep = self._mask & (value != self.ignore_index)
        if value.shape == self._tokens.shape and bool(((value == self._tokens) | ~keep).all()):
            return torch.where(keep, self._log_probs, 0.0)
        return self._rescore(value, keep)

    def _rescore(self, value: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Log-probs of other tokens than the scored ones: one more chunked pass."""
        flat = value.reshape(-1, *self._mask.shape)
        targets = flat[:, self._mask].clamp_min(0).T  # [N, S]; ignore_index is zeroed below
        token, _ = self._scorer.stats(targets.contiguous(), with_entropy=False)
        scored = self._scatter(token.T).reshape(value.shape)
        return torch.where(keep, scored, 0.0)

    def entropy(self) -> torch.Tensor:
        """Per-position entropy `[B, T]`, 0 where the mask is False."""
        if self._entropy is None:
            targets = torch.zeros_like(self._scorer.positions)
            _, entropy = self._scorer.stats(targets, with_entropy=True)
            self._entropy = self._scatter(entropy)
        return self._entropy

    def sample(self, sample_shape: Sequence[int] | torch.Size = ()) -> torch.Tensor:
        """Token ids `[*sample_shape, B, T]`; `ignore_index` where the mask is False."""
        shape = torch.Size(sample_shape)
        drawn = self._scorer.sample(shape)
        mask = self._mask.expand(*shape, *self._mask.shape)
        return torch.full_like(mask, self.ignore_index, dtype=torch.long).masked_scatter(
            mask, drawn
        )

    def rsample(self, sample_shape: Sequence[int] | torch.Size = ()) -> torch.Tensor:
        """No reparameterization for a categorical: a plain sample, as LLMMaskedCategorical."""
        return self.sample(sample_shape)
