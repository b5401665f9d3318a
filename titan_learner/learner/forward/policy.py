"""A TorchRL LLM actor over a TorchTitan decoder, so torchrl.objectives.llm losses run on it.

TorchRL's LLM losses ask the actor for a masked categorical over a left-padded `[B, T]` batch,
with the shifted convention: `logits[:, t]` scores token t and position 0 is zeros. A causal model
must not attend to left padding, and TorchTitan's SDPA path is causal-only (no padding mask), so
each row is left-justified before the forward (real tokens first, positions 0..n-1) and the
logits are put back in the caller's layout afterwards. Padding then only ever follows real tokens,
which causal attention never looks at: log-probs equal those of the unpadded sequence.

With `logprob_chunk_size > 0` the distributions the losses ask for (`_get_*_dist`, and
`get_dist` with a `mask_key`) never see `[B, T, V]` logits: the decoder runs without its lm_head
and `titan_learner.logprobs` scores the masked positions chunk by chunk; a batch whose positions
fit one chunk and whose logits are small is scored whole instead, without the chunked path's
host read (`titan_learner.learner.forward.justified_stats`). `forward` and `token_logits` stay dense for
other callers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tensordict import NestedKey, TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor
from torchrl.modules.llm.policies.common import LLMWrapperBase

from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    PROMPT_TOKENS_KEY,
    TOKENS_KEY,
)
from titan_learner.learner.forward.justified_stats import WHOLE_BATCH_LOGITS, justified_token_stats
from titan_learner.learner.forward.logprobs import ChunkedTokenCategorical, TokenScorer
from titan_learner.learner.forward.shared_prompts import enable_prompt_sharing, plan_stream
from titan_learner.model.spec import uses_flex_attention


def left_justify_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row permutation that puts real tokens first, in order: gather with it to justify.

    A stable descending sort of the bool mask itself (True first, each kind in its order).
    """
    return torch.argsort(attention_mask, dim=1, descending=True, stable=True)


@contextmanager
def lm_head_skipped(model: nn.Module) -> Iterator[None]:
    """TorchTitan's decoder returns its final-norm hidden states instead of logits, meanwhile.

    The flag is a plain attribute (never a parameter, buffer or submodule): it is written
    straight into the instance, without `nn.Module.__setattr__`'s lookups.
    """
    state = vars(model)
    previous = model._skip_lm_head
    state["_skip_lm_head"] = True
    try:
        yield
    finally:
        state["_skip_lm_head"] = previous


class TitanPolicy(LLMWrapperBase):
    """Log-prob (non-generating) actor over a TorchTitan model; the model may be sharded.

    logprob_chunk_size: 0 gives the losses TorchRL's dense `LLMMaskedCategorical` over
    `token_logits`; N > 0 gives a `ChunkedTokenCategorical` that runs the lm_head on N scored
    positions at a time (FSDP and tensor parallel included: see titan_learner.logprobs).
    compute_entropy: (chunked only) compute the entropy in the same chunked pass, for the
    losses' entropy bonus and the learner's `entropy` metric (unused by the loss, it adds no
    backward work); False saves the forward's share, and `entropy()` then costs one more
    chunked pass if it is called after all.
    share_prompts: (chunked only) the decoder runs on a stream of the tokens the scores need,
    each prompt once for the rows that share it (titan_learner.learner.forward.shared_prompts).
    """

    def __init__(
        self,
        model: nn.Module,
        logprob_chunk_size: int = 0,
        compute_entropy: bool = True,
        share_prompts: bool = False,
    ) -> None:
        super().__init__()
        if logprob_chunk_size < 0:
            raise ValueError(f"logprob_chunk_size must be >= 0, got {logprob_chunk_size}")
        if share_prompts:
            if logprob_chunk_size < 1:
                raise ValueError(
                    "share_prompts needs the chunked log-prob path (logprob_chunk_size >= 1)"
                )
            enable_prompt_sharing(model)  # raises unless the model runs TorchTitan's SDPA
        self.model = model
        self._flex_attention = uses_flex_attention(model)  # fixed when the model is built
        self.logprob_chunk_size = logprob_chunk_size
        self.share_prompts = share_prompts
        self.compute_entropy = compute_entropy
        self.generate = False
        self.pad_output = True
        self.input_mode = "tokens"
        self.tokenizer = None
        self.in_keys = [TOKENS_KEY, ATTENTION_MASK_KEY]
        self.out_keys = ["logits"]

    def _justified_forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        order: torch.Tensor,
        width: int | None = None,
    ) -> torch.Tensor:
        """The model on left-justified rows: logits, or hidden states under `lm_head_skipped`.

        `width`: run only the first `width` justified positions (causal attention: the ones
        kept see exactly what they saw in the whole row). Padding ids are never read (the batch
        check ignores them, and causal attention never looks at the padding that follows a
        row's tokens), but the embedding still looks them up: they become id 0 (the integer
        product with the mask, one operator where `where` takes two), so that any pad id works
        (TorchRL's -100 included).
        """
        order = order if width is None else order[:, :width]
        justified = (tokens * attention_mask).gather(1, order)
        masks = None
        if self._flex_attention:
            positions = torch.arange(order.shape[1], device=tokens.device).expand_as(order)
            masks = self.model.get_attention_masks(positions)
        return self.model(justified, attention_masks=masks)

    def token_logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Shifted float32 logits `[B, T, V]` in the caller's (left-padded) layout."""
        order = left_justify_order(attention_mask)
        out = self._justified_forward(tokens, attention_mask, order)
        if isinstance(out, DTensor):  # tensor-parallel lm_head with loss parallel
            out = out.full_tensor()
        out = out.float()
        shifted = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        inverse = torch.argsort(order, dim=1)
        return shifted.gather(1, inverse.unsqueeze(-1).expand_as(shifted))

    def token_dist(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor
    ) -> ChunkedTokenCategorical:
        """The chunked distribution over `tokens`, scoring the positions where `mask` is True.

        Same layout rules as `token_logits` (left-justified forward, shifted scores), but the
        decoder stops at its final norm and only the masked positions ever reach the lm_head.
        """
        if self.logprob_chunk_size < 1:
            raise ValueError("token_dist needs logprob_chunk_size >= 1 (0 is the dense path)")
        mask = mask.bool()
        order = left_justify_order(attention_mask)
        if self._scores_whole(tokens, mask):
            return self._whole_batch_dist(tokens, attention_mask, mask, order)
        inverse = torch.argsort(order, dim=1)  # caller position -> justified position
        plan = (
            plan_stream(tokens, attention_mask, mask, order)
            if self.share_prompts and mask.numel()
            else None
        )
        # The one host synchronization of the path, taken before the decoder's forward is
        # queued so that on a GPU it waits for no kernel: how many positions are scored, the
        # last justified position any of them takes, how many have a position before them
        # (and, sharing prompts, how many tokens the stream holds). The decoder runs up to the
        # one before the last: no scored token reads a later hidden state (the last position
        # of the longest row never does), so the forward and backward skip that work.
        counts = []
        if mask.numel():
            columns = inverse * mask  # each scored position's justified one, 0 elsewhere
            counts = [mask.sum(), columns.amax(), (columns > 0).sum()]
        if plan is not None:
            counts.append(plan.keep.sum())
        count, last, preceded, *streamed = torch.stack(counts).tolist() if counts else (0, 0, 0)
        positions = torch.nonzero_static(mask.reshape(-1), size=count).squeeze(1)  # row-major
        width = max(last, 1)
        rows = None
        with lm_head_skipped(self.model):
            if plan is not None and streamed[0]:
                stream, stream_positions, sharing = plan.layout(streamed[0], width)
                hidden = self.model(stream, positions=stream_positions, attention_masks=sharing)
                rows = sharing.rows
            else:
                hidden = self._justified_forward(tokens, attention_mask, order, width)
        if isinstance(hidden, DTensor):  # tensor parallel: the final norm's output, replicated
            hidden = hidden.full_tensor()
        scorer = self._scorer(hidden, inverse, positions, width, rows, preceded < count)
        return ChunkedTokenCategorical(scorer, tokens, mask, with_entropy=self.compute_entropy)

    def _scores_whole(self, tokens: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether the batch is scored whole, without a host read
        (titan_learner.learner.forward.justified_stats): every position fits one lm_head chunk and
        their logits are small (`WHOLE_BATCH_LOGITS`), some position is scored, rows hold two
        tokens or more, and no prompt is shared."""
        return (
            not self.share_prompts
            and mask.numel() > 0
            and tokens.shape[1] > 1
            and tokens.numel() <= self.logprob_chunk_size
            and tokens.numel() * self.model.config.vocab_size <= WHOLE_BATCH_LOGITS
        )

    def _whole_batch_dist(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        mask: torch.Tensor,
        order: torch.Tensor,
    ) -> ChunkedTokenCategorical:
        """`token_dist` of a batch scored whole: every justified position runs through the
        decoder and scores the next one, the last one the first (`justified_token_stats`). The
        `TokenScorer` that other values, a second entropy pass or sampling would need is
        built only if one of them is asked for."""
        width = tokens.shape[1]
        with lm_head_skipped(self.model):
            hidden = self._justified_forward(tokens, attention_mask, order)
        if isinstance(hidden, DTensor):  # tensor parallel: the final norm's output, replicated
            hidden = hidden.full_tensor()
        vocab_size = self.model.config.vocab_size
        stats = justified_token_stats(
            hidden, self.model.lm_head, tokens, order, mask, self.compute_entropy
        )
        chunk_size = self.logprob_chunk_size

        def scorer() -> TokenScorer:
            positions = mask.reshape(-1).nonzero().squeeze(1)  # a host read, if ever needed
            inverse = torch.argsort(order, dim=1)
            return self._scorer(hidden, inverse, positions, width, chunk_size=chunk_size)

        return ChunkedTokenCategorical(
            scorer,
            tokens,
            mask,
            with_entropy=self.compute_entropy,
            stats=stats,
            vocab_size=vocab_size,
        )

    def _scorer(
        self,
        hidden: torch.Tensor,
        inverse: torch.Tensor,
        positions: torch.Tensor,
        width: int,
        rows: torch.Tensor | None = None,
        any_unscored: bool = True,
        chunk_size: int | None = None,
    ) -> TokenScorer:
        """Keep, for each scored position (flat indices `positions` into the `[B, T]` batch,
        whose justified positions are `inverse`), the justified hidden state one position
        before it. `hidden`: `[B, W, D]`, the first W = `width` justified positions; or, with
        `rows` (`PromptSharing.rows`, `[B, W]`), the stream's `[1, N, D]`.

        Only these `[N, D]` rows go on to the lm_head: unmasked positions score 0 and get no
        gradient in the dense distribution either, so skipping them changes nothing.
        `any_unscored`: False when the caller knows every scored position has one before it.
        `chunk_size`: the lm_head's chunk (the policy's own when None).
        """
        column = inverse.reshape(-1).index_select(0, positions)
        row = positions.div(inverse.shape[1], rounding_mode="floor")
        before = torch.add(column, row, alpha=width).sub_(1)  # row * width + column - 1
        unscored = None
        if any_unscored:
            # A row's first real token has no position before it (`unscored`): the state it
            # reads instead gets no gradient, as its score is replaced by a constant.
            unscored = column == 0
            before = before.clamp_min(0)
        if rows is not None:  # the stream's index of that justified position
            before = rows.reshape(-1).index_select(0, before)
        return TokenScorer(
            hidden=hidden.reshape(-1, hidden.shape[-1]).index_select(0, before),
            unscored=unscored,
            positions=positions,
            head=self.model.lm_head,
            vocab_size=self.model.config.vocab_size,
            chunk_size=chunk_size or self.logprob_chunk_size,
        )

    def _chunked_dist(self, tensordict: TensorDictBase, mask: torch.Tensor | None):
        if mask is None:
            raise ValueError("the chunked log-prob path needs a [B, T] position mask, got None")
        return self.token_dist(tensordict.get(TOKENS_KEY), tensordict.get(ATTENTION_MASK_KEY), mask)

    # -- the distributions TorchRL's LLM losses ask for (chunked when logprob_chunk_size > 0) --

    def _get_dist_with_assistant_mask(
        self,
        tensordict: TensorDictBase,
        assistant_mask_key: NestedKey = ASSISTANT_MASK_KEY,
        logits_key: NestedKey = "logits",
        padding_side: str = "left",
        **kwargs,
    ):
        if not self.logprob_chunk_size:
            return super()._get_dist_with_assistant_mask(
                tensordict, assistant_mask_key, logits_key, padding_side, **kwargs
            )
        return self._chunked_dist(tensordict, tensordict.get(assistant_mask_key))

    def _get_dist_with_attention_mask(
        self,
        tensordict: TensorDictBase,
        attention_mask_key: NestedKey = ATTENTION_MASK_KEY,
        logits_key: NestedKey = "logits",
        padding_side: str = "left",
        **kwargs,
    ):
        if not self.logprob_chunk_size:
            return super()._get_dist_with_attention_mask(
                tensordict, attention_mask_key, logits_key, padding_side, **kwargs
            )
        return self._chunked_dist(tensordict, tensordict.get(attention_mask_key))

    def _get_dist_with_prompt_mask(
        self,
        tensordict: TensorDictBase,
        tokens_key: NestedKey = PROMPT_TOKENS_KEY,
        logits_key: NestedKey = "logits",
        assistant_mask_key: NestedKey = ASSISTANT_MASK_KEY,
        attention_mask_key: NestedKey = ATTENTION_MASK_KEY,
        padding_side: str = "left",
        **kwargs,
    ):
        if not self.logprob_chunk_size:
            return super()._get_dist_with_prompt_mask(
                tensordict,
                tokens_key,
                logits_key,
                assistant_mask_key,
                attention_mask_key,
                padding_side,
                **kwargs,
            )
        prompt = tensordict.get(tokens_key, None)
        if prompt is None:  # TorchRL's rule: no prompt tokens, the assistant mask decides
            return self._chunked_dist(tensordict, tensordict.get(assistant_mask_key))
        response = tensordict.get(attention_mask_key).clone()
        response[..., : prompt.shape[-1]] = False
        return self._chunked_dist(tensordict, response)

    def _get_dist_with_custom_mask(
        self,
        tensordict: TensorDictBase,
        mask: torch.Tensor,
        logits_key: NestedKey = "logits",
        padding_side: str = "left",
        **kwargs,
    ):
        if not self.logprob_chunk_size:
            return super()._get_dist_with_custom_mask(
                tensordict, mask, logits_key, padding_side, **kwargs
            )
        return self._chunked_dist(tensordict, mask)

    def get_dist(
        self,
        tensordict: TensorDictBase,
        tensordict_out: TensorDictBase | None = None,
        logits_key: NestedKey = "logits",
        mask_key: NestedKey | None = None,
        **kwargs,
    ):
        """Chunked with a `mask_key`; without one TorchRL builds a dense token-level mask."""
        if self.logprob_chunk_size and mask_key is not None:
            return self._chunked_dist(tensordict, tensordict.get(mask_key))
        return super().get_dist(tensordict, tensordict_out, logits_key, mask_key, **kwargs)

    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        tensordict_out: TensorDictBase | None = None,
        logits_only: bool = False,
        **kwargs,
    ) -> TensorDictBase:
        out = tensordict if tensordict_out is None else tensordict_out
        logits = self.token_logits(tensordict.get(TOKENS_KEY), tensordict.get(ATTENTION_MASK_KEY))
        out.set("logits", logits)
        return out
