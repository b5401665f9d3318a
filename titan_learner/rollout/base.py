"""The generator contract: the `Generator` protocol, `Rollout` and its conversion into the
learner's batch, and the argument checks every implementation makes.

Behaviour log-probs are the temperature-1 log-probs of the sampled tokens, whatever temperature
was sampled at. GRPO's importance ratio is exp(log pi_theta(a) - log_probs(a)), where the learner's
policy (titan_learner.learner.forward.policy) evaluates pi_theta from unscaled logits, i.e. at temperature 1. For
that ratio to be exactly 1 on data from the same weights (on-policy), so that clipping and the
KL-to-inference estimate only see staleness, the behaviour log-probs must come from the same
temperature-1 distribution. What this does not correct: at temperature != 1 the tokens were drawn
from pi^(1/T) rather than pi, a bias the loss ignores (as most GRPO implementations do). Sample at
temperature 1 for training (the measured recipe does), or scale the learner's logits by 1/T and
return scaled log-probs here: both sides must change together.

Rollout order: the G completions of prompt p are rows p*G .. p*G + G-1 ("group p"), the layout
`titan_learner.advantage.group_advantages` expects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
)

REWARD_KEY = "reward"
GROUP_ID_KEY = "group_id"
FINISHED_KEY = "finished"
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


# ---------------------------------------------------------------------------------------------
# Rollout: what a generator returns, and its conversion into the learner's batch format


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded int64 tokens `[n, L]` and the bool mask of real tokens."""
    width = max((len(s) for s in sequences), default=0)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if len(seq):
            tokens[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.int64)
            mask[row, width - len(seq) :] = True
    return tokens, mask


def _per_sequence(value: torch.Tensor, n: int, name: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.shape not in ((n,), (n, 1), (n, 1, 1)):
        raise ValueError(
            f"{name} must hold one value per sequence: [N], [N, 1] or [N, 1, 1] with N={n}, "
            f"got {tuple(value.shape)}"
        )
    return value.reshape(n).float()


@dataclass(frozen=True, eq=False)
class Rollout:
    """G completions for each of P prompts, with the behaviour log-probs of their tokens.

    `completion_tokens[i, :completion_lengths[i]]` is row i's completion (EOS included when it was
    sampled; `finished[i]` says so); the rest of the row is `pad_id`. `completion_log_probs` is
    the temperature-1 log-prob of each sampled token, NaN past the end. Row i answers prompt
    `prompts[i // group_size]`.
    """

    prompts: list[list[int]]
    group_size: int
    completion_tokens: torch.Tensor  # [N, M] int64
    completion_log_probs: torch.Tensor  # [N, M] float32
    completion_lengths: torch.Tensor  # [N] int64
    finished: torch.Tensor  # [N] bool
    pad_id: int
    weights_version: int
    completion_mask: torch.Tensor | None = None  # [N, M] bool
    """Multi-turn episodes (titan_learner.env): which completion positions the model sampled
    (the rest are tool and environment tokens, context that is not trained); None: all."""

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        n = len(self.prompts) * self.group_size
        if self.completion_tokens.dim() != 2 or self.completion_tokens.shape[0] != n:
            raise ValueError(
                f"completion_tokens must be [N, M] with N = {len(self.prompts)} prompts x "
                f"{self.group_size} = {n}, got {tuple(self.completion_tokens.shape)}"
            )
        shape = self.completion_tokens.shape
        if self.completion_log_probs.shape != shape:
            raise ValueError(
                f"completion_log_probs must be {tuple(shape)} like completion_tokens, "
                f"got {tuple(self.completion_log_probs.shape)}"
            )
        if self.completion_lengths.shape != (n,) or self.finished.shape != (n,):
            raise ValueError(f"completion_lengths and finished must be [{n}]")
        if self.completion_mask is not None and self.completion_mask.shape != shape:
            raise ValueError(
                f"completion_mask must be {tuple(shape)} like completion_tokens, "
                f"got {tuple(self.completion_mask.shape)}"
            )

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.group_size

    @property
    def group_ids(self) -> torch.Tensor:
        """`[N]` int64: the index of the prompt each row answers."""
        return torch.arange(len(self.prompts)).repeat_interleave(self.group_size)

    @property
    def completion_ids(self) -> list[list[int]]:
        """Each row's completion as a list of ids (EOS included when sampled)."""
        rows = self.completion_tokens.tolist()
        return [row[:n] for row, n in zip(rows, self.completion_lengths.tolist(), strict=True)]

    def to_batch(self, advantage: torch.Tensor, rewards: torch.Tensor) -> TensorDict:
        """The learner's batch (titan_learner.learner.batch): prompt + completion, left-padded to `[N, T]`.

        The response mask covers the sampled tokens, EOS included (of a multi-turn episode: the
        model's turns, not the tools' and environment's, `completion_mask`); `("log_probs", "full")` holds
        the behaviour log-probs there and NaN elsewhere; `advantage` is `[N, 1, 1]`. Three extra
        per-sequence entries ride along: `"reward"` (float32), `"group_id"` (int64) and
        `"finished"` (bool: ended with an EOS, not cut at max_new_tokens).
        """
        n = self.num_sequences
        advantage = _per_sequence(advantage, n, "advantage")
        rewards = _per_sequence(rewards, n, "rewards")
        prompt_tokens, prompt_mask = left_pad(self.prompts, self.pad_id)
        prompt_tokens = prompt_tokens.repeat_interleave(self.group_size, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(self.group_size, dim=0)
        width = self.completion_tokens.shape[1]
        response = torch.arange(width) < self.completion_lengths.unsqueeze(1)
        sampled = (
            response if self.completion_mask is None else response & self.completion_mask.cpu()
        )
        tokens = torch.cat([prompt_tokens, self.completion_tokens.cpu()], dim=1)
        real = torch.cat([prompt_mask, response], dim=1)
        assistant = torch.cat([torch.zeros_like(prompt_mask), sampled], dim=1)
        log_probs = torch.cat(
            [torch.full(prompt_mask.shape, torch.nan), self.completion_log_probs.cpu().float()], 1
        )
        # [prompt | pad | completion | pad] -> [pad | prompt | completion]: a stable sort puts
        # padding (False) first and keeps the real tokens in order
        order = torch.argsort(real.to(torch.int8), dim=1, stable=True)
        length = int(real.sum(1).max()) if n else 0
        tokens, real, assistant, log_probs = (
            x.gather(1, order)[:, x.shape[1] - length :]
            for x in (tokens, real, assistant, log_probs)
        )
        return TensorDict(
            {
                TOKENS_KEY: torch.where(real, tokens, self.pad_id),
                ATTENTION_MASK_KEY: real,
                ASSISTANT_MASK_KEY: assistant,
                LOG_PROBS_KEY: torch.where(assistant, log_probs, torch.nan),
                ADVANTAGE_KEY: advantage.reshape(n, 1, 1),
                REWARD_KEY: rewards,
                GROUP_ID_KEY: self.group_ids,
                FINISHED_KEY: self.finished.cpu().bool(),
            },
            batch_size=[n],
        )


def rollout_from_lists(
    prompts: list[list[int]],
    group_size: int,
    completions: list[list[int]],
    log_probs: list[list[float]],
    eos_id: int | Sequence[int],
    pad_id: int,
    weights_version: int,
) -> Rollout:
    """A Rollout from ragged per-row completions and log-probs (what an engine returns)."""
    n = len(completions)
    width = max((len(c) for c in completions), default=0)
    tokens = torch.full((n, width), pad_id, dtype=torch.int64)
    values = torch.full((n, width), torch.nan)
    for row, (ids, lps) in enumerate(zip(completions, log_probs, strict=True)):
        if len(ids) != len(lps):
            raise ValueError(f"row {row}: {len(ids)} tokens but {len(lps)} log-probs")
        tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        values[row, : len(lps)] = torch.as_tensor(lps, dtype=torch.float32)
    return Rollout(
        prompts=[list(map(int, p)) for p in prompts],
        group_size=group_size,
        completion_tokens=tokens,
        completion_log_probs=values,
        completion_lengths=torch.tensor([len(c) for c in completions], dtype=torch.int64),
        finished=torch.tensor([bool(c) and c[-1] in eos_id_set(eos_id) for c in completions]),
        pad_id=pad_id,
        weights_version=weights_version,
    )


# ---------------------------------------------------------------------------------------------
# The interface


@runtime_checkable
class Generator(Protocol):
    """Samples rollouts and takes new weights from the learner.

    `generate` returns `group_size` completions per prompt, each stopping at EOS or after
    `max_new_tokens`; temperature 0 is greedy. The result is a function of the weights, the
    inputs and the state of `generator` (a `torch.Generator` on the generator's device).
    `load_weights` takes Hugging Face-named tensors and the learner's policy version; it checks
    every name and shape before it changes anything.
    """

    weights_version: int

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Rollout: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None: ...


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    vocab_size: int,
    generator: torch.Generator,
) -> None:
    """The argument checks every generator makes, with errors that say what is allowed."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (rollouts are seeded), got {type(generator).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}) (the model's vocab_size): "
                f"{list(prompt)}"
            )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")


def _check_config(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def eos_id_set(eos_id: int | Sequence[int]) -> tuple[int, ...]:
    """One EOS id or several (Qwen's tokenizer and generation config name more than one)."""
    ids = (eos_id,) if isinstance(eos_id, int) else tuple(int(i) for i in eos_id)
    if not ids:
        raise ValueError("eos_id names no token: pass an id or a non-empty list of ids")
    return ids


def _check_special_ids(eos_id: int | Sequence[int], pad_id: int, vocab_size: int) -> None:
    named = [(f"eos_id {value}", value) for value in eos_id_set(eos_id)] + [("pad_id", pad_id)]
    for name, value in named:
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}={value} is outside [0, {vocab_size}) (the vocab_size)")
