"""The batch format `Learner.update` takes, checked before any compute.

Each rank passes its own local batch of B sequences, left-padded to a common length T:

| key                                | dtype   | shape                 | meaning                                  |
|------------------------------------|---------|-----------------------|------------------------------------------|
| ("tokens", "full")                 | int64   | [B, T]                | prompt + response token ids              |
| ("masks", "all_attention_mask")    | bool    | [B, T]                | True on real (non-padding) tokens        |
| ("masks", "all_assistant_mask")    | bool    | [B, T]                | True on response tokens the loss trains  |
| ("log_probs", "full")              | float32 | [B, T]                | behaviour (sampling) log-probs           |
| "advantage"                        | float32 | [B], [B, 1], [B,1,1] or [B, T, 1] | per-sequence or per-token |
| ("next", "ref_log_probs", "full")  | float32 | [B, T]                | only with kl_to_ref_coeff                |

Ranks of one tensor-parallel group pass the same batch; data-parallel ranks pass different ones.
"""

from __future__ import annotations

import math
import weakref

import torch
from tensordict import TensorDict, TensorDictBase

TOKENS_KEY = ("tokens", "full")
PROMPT_TOKENS_KEY = ("tokens", "prompt")
ATTENTION_MASK_KEY = ("masks", "all_attention_mask")
ASSISTANT_MASK_KEY = ("masks", "all_assistant_mask")
LOG_PROBS_KEY = ("log_probs", "full")
REF_LOG_PROBS_KEY = ("next", "ref_log_probs", "full")
ADVANTAGE_KEY = "advantage"
REQUIRED_KEYS = (TOKENS_KEY, ATTENTION_MASK_KEY, ASSISTANT_MASK_KEY, LOG_PROBS_KEY, ADVANTAGE_KEY)


class BatchError(ValueError):
    """A batch that does not follow the documented format; raised before any compute."""


def _fmt(key) -> str:
    return repr(key) if isinstance(key, tuple) else f"'{key}'"


def check_batch(
    batch: TensorDictBase,
    vocab_size: int,
    needs_ref_log_probs: bool,
    device: torch.device | None = None,
) -> TensorDictBase:
    """Validate `batch` and return it (on `device`, when given) with the advantage shaped as
    TorchRL's loss wants it: the same TensorDict when nothing had to change, else a shallow
    copy (`batch` itself is never modified). The value checks cost one host synchronization."""
    return check_and_count(batch, vocab_size, needs_ref_log_probs, device)[0]


def check_and_count(
    batch: TensorDictBase,
    vocab_size: int,
    needs_ref_log_probs: bool,
    device: torch.device | None = None,
) -> tuple[TensorDictBase, int]:
    """`check_batch`, and the number of trained tokens (response positions with a finite
    behaviour log-prob, what the loss masks in), read in the same host synchronization."""
    if not isinstance(batch, TensorDictBase):
        raise BatchError(f"update() takes a TensorDict, got {type(batch).__name__}")
    required = (*REQUIRED_KEYS, REF_LOG_PROBS_KEY) if needs_ref_log_probs else REQUIRED_KEYS
    values = {key: batch.get(key, None) for key in required}
    missing = [_fmt(k) for k, v in values.items() if not isinstance(v, torch.Tensor)]
    if missing:
        raise BatchError(
            f"batch is missing {', '.join(missing)}; required keys: "
            + ", ".join(_fmt(k) for k in required)
        )
    tokens = values[TOKENS_KEY]
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise BatchError(
            f"{_fmt(TOKENS_KEY)} must be an integer tensor [B, T], "
            f"got {tokens.dtype} {tuple(tokens.shape)}"
        )
    shape = tokens.shape
    for key in (ATTENTION_MASK_KEY, ASSISTANT_MASK_KEY):
        mask = values[key]
        if mask.dtype != torch.bool or mask.shape != shape:
            raise BatchError(
                f"{_fmt(key)} must be bool {tuple(shape)} like the tokens, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
    for key in (LOG_PROBS_KEY, REF_LOG_PROBS_KEY) if needs_ref_log_probs else (LOG_PROBS_KEY,):
        value = values[key]
        if not value.is_floating_point() or value.shape != shape:
            raise BatchError(
                f"{_fmt(key)} must be float {tuple(shape)} like the tokens, "
                f"got {value.dtype} {tuple(value.shape)}"
            )
        if value.requires_grad:
            raise BatchError(f"{_fmt(key)} must not require grad (behaviour log-probs are data)")
    if device is not None and tokens.device != device:
        batch = batch.to(device)
        values = {key: batch.get(key) for key in required}
    advantage = values[ADVANTAGE_KEY]
    B, T = shape
    if advantage.shape in ((B,), (B, 1)):
        advantage = advantage.reshape(B, 1, 1)
    elif advantage.shape not in ((B, 1, 1), (B, T, 1)):
        raise BatchError(
            f"'advantage' must be [B], [B, 1], [B, 1, 1] or [B, T, 1] with B={B}, T={T}, "
            f"got {tuple(advantage.shape)}"
        )
    on_padding, lowest, highest, trained = _value_checks(values).tolist()
    if on_padding:
        raise BatchError(
            f"{_fmt(ASSISTANT_MASK_KEY)} marks padding positions; it must be a subset of "
            f"{_fmt(ATTENTION_MASK_KEY)}"
        )
    if lowest < 0 or highest >= vocab_size:
        tokens, attention = values[TOKENS_KEY], values[ATTENTION_MASK_KEY]
        real = tokens[attention]  # the error path only: the exact range of the real tokens
        raise BatchError(
            f"token ids must lie in [0, {vocab_size}) (the model's vocab_size), "
            f"got [{int(real.min())}, {int(real.max())}]"
        )
    if advantage is values[ADVANTAGE_KEY] and advantage.dtype == torch.float32:
        return batch, trained  # nothing to reshape or cast: no copy of the TensorDict
    out = batch.clone(recurse=False)
    out.set(ADVANTAGE_KEY, advantage.float())
    return out, trained


def _value_checks(values: dict) -> torch.Tensor:
    """[response positions on padding, lowest real token id, highest, trained tokens] as one
    int64 tensor, for one host read. Padding counts as token id 0 (always valid), so the range
    is exact only when it is valid; the error path takes the real tokens' own."""
    tokens = values[TOKENS_KEY]
    if not tokens.numel():
        return torch.zeros(4, dtype=torch.int64)
    attention, assistant = values[ATTENTION_MASK_KEY], values[ASSISTANT_MASK_KEY]
    lowest, highest = (tokens * attention).aminmax()  # padding as id 0
    checks = [(assistant > attention).sum(), lowest, highest]
    if tokens.dtype != torch.int64:
        checks = [check.long() for check in checks]
    return torch.stack([*checks, trained_tokens(assistant, values[LOG_PROBS_KEY])])


def trained_mask(assistant_mask: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """The positions the loss trains: response tokens with a finite behaviour log-prob.

    |x| < inf is `isfinite(x)` (NaN compares False) in two operators where `torch.isfinite`
    takes four on a CPU. The batch check and the loss's log-weight ask for the mask of the
    same two tensors in one update (the loss's distribution mask is the batch's assistant
    mask itself): the second call gets the first's (`_LastTrainedMask`)."""
    mask = _LAST_TRAINED_MASK.get(assistant_mask, log_probs)
    if mask is None:
        mask = assistant_mask & (log_probs.abs() < math.inf)
        _LAST_TRAINED_MASK.keep(assistant_mask, log_probs, mask)
    return mask


class _LastTrainedMask:
    """The last trained mask, for the same two tensors unchanged since (three operators, ~60 us
    inside a step on a CPU). Weak references keep no batch alive; a tensor written in place
    since (its version moved) is masked again, as is a mask written in place; inference
    tensors, which count no versions, are never kept."""

    def __init__(self) -> None:
        self._last: tuple | None = None

    def get(self, assistant_mask: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor | None:
        last = self._last
        if last is None:
            return None
        assistant_ref, log_probs_ref, mask, versions = last
        if assistant_ref() is not assistant_mask or log_probs_ref() is not log_probs:
            return None
        return mask if _versions(assistant_mask, log_probs, mask) == versions else None

    def keep(
        self, assistant_mask: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor
    ) -> None:
        if any(t.is_inference() for t in (assistant_mask, log_probs, mask)):
            self._last = None
            return
        versions = _versions(assistant_mask, log_probs, mask)
        self._last = (weakref.ref(assistant_mask), weakref.ref(log_probs), mask, versions)


def _versions(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)


_LAST_TRAINED_MASK = _LastTrainedMask()


def trained_tokens(assistant_mask: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """How many positions the loss trains (`trained_mask`'s count)."""
    return trained_mask(assistant_mask, log_probs).sum()


def synthetic_batch(
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    generator: torch.Generator,
    varied: bool = False,
) -> TensorDict:
    """A well-formed random GRPO batch: left-padded prompts, responses, sampled log-probs.

    varied=False: every row trains the same number of response tokens (seq_len // 2), so any
    split of the rows has the same token mean as the whole. varied=True: real batches'
    shape: each row has its own length (2..seq_len) and response length (1..its length - 1),
    so rows, ranks and micro-batches train different numbers of tokens.
    """
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    if varied:
        real = torch.randint(2, seq_len + 1, (batch_size,), generator=generator)
        response = (torch.rand(batch_size, generator=generator) * (real - 1)).long() + 1
    else:
        response = torch.full((batch_size,), max(1, seq_len // 2))
        pad = torch.randint(0, seq_len - int(response[0]), (batch_size,), generator=generator)
        real = seq_len - pad
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    attention = positions >= (seq_len - real).unsqueeze(1)
    assistant = positions >= (seq_len - response).unsqueeze(1)
    tokens = torch.where(attention, tokens, 0)
    log_probs = -torch.rand(batch_size, seq_len, generator=generator) * 3.0
    advantage = torch.randn(batch_size, 1, 1, generator=generator)
    return batch_from_parts(tokens, attention, assistant, log_probs, advantage)


def batch_from_parts(
    tokens: torch.Tensor,
    attention: torch.Tensor,
    assistant: torch.Tensor,
    log_probs: torch.Tensor,
    advantage: torch.Tensor,
) -> TensorDict:
    """The batch format from its `[B, T]` parts (the behaviour log-probs NaN off the response)
    and a `[B, 1, 1]` advantage: what synthetic batches and benchmarks build."""
    return TensorDict(
        {
            TOKENS_KEY: tokens,
            ATTENTION_MASK_KEY: attention,
            ASSISTANT_MASK_KEY: assistant,
            LOG_PROBS_KEY: torch.where(assistant, log_probs, torch.nan),
            ADVANTAGE_KEY: advantage,
        },
        batch_size=[tokens.shape[0]],
    )


def grouped_synthetic_batch(
    prompts: int, group_size: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> TensorDict:
    """A GRPO batch as a rollout makes it: `prompts` groups of `group_size` consecutive rows
    that share their prompt (1..seq_len // 2 tokens, its own per group), each row with its own
    response (1..the rest), left-padded to `seq_len`; sampled log-probs on the responses."""
    rows = prompts * group_size
    prompt = torch.randint(1, seq_len // 2 + 1, (prompts,), generator=generator)
    prompt_tokens = torch.randint(0, vocab_size, (prompts, seq_len), generator=generator)
    prompt = prompt.repeat_interleave(group_size)
    response = (torch.rand(rows, generator=generator) * (seq_len - prompt)).long() + 1
    real = prompt + response
    positions = torch.arange(seq_len).expand(rows, seq_len)
    start = (seq_len - real).unsqueeze(1)  # left padding
    # the prompt's i-th token is the group's i-th drawn id, whatever the row's padding
    offset = (positions - start).clamp(0, seq_len - 1)
    shared = prompt_tokens.repeat_interleave(group_size, 0).gather(1, offset)
    own = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    attention = positions >= start
    assistant = positions >= (start + prompt.unsqueeze(1))
    tokens = torch.where(assistant, own, torch.where(attention, shared, 0))
    log_probs = -torch.rand(rows, seq_len, generator=generator) * 3.0
    advantage = torch.randn(rows, 1, 1, generator=generator)
    return batch_from_parts(tokens, attention, assistant, log_probs, advantage)
