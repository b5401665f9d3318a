"""What a verifiable task gives the GRPO job: prompts to sample, a reward to check, ids to stop on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Task:
    """A verifiable task over a built-in vocabulary.

    `sample_prompts(n, generator)` returns n prompts as token-id lists, reproducible under the
    seeded CPU `torch.Generator`. `reward(prompt_ids, completion_ids)` scores one completion (the
    sampled tokens after the prompt, EOS included when it was sampled) in [0, 1].
    `max_new_tokens` is a suggestion: enough for a right answer plus its EOS, with a little slack.
    """

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int
    max_new_tokens: int
    sample_prompts: Callable[[int, torch.Generator], list[list[int]]]
    reward: Callable[[Sequence[int], Sequence[int]], float]
    decode: Callable[[Sequence[int]], str]
