"""The "sort digits ascending" task: BOS d1..dk SEP -> the k digits sorted, then EOS.

The reward gives partial credit, the fraction of response positions that are right, so an early
policy that gets some digits in place already has a gradient (a 0/1 reward on 4-6 digits is almost
never 1 at the start). The target is `sorted(digits) + [EOS]`:

- position i of the response is right when it equals position i of the target;
- the denominator is max(len(target), len(response)), so extra tokens before the EOS cost credit;
- EOS is part of the answer: a response that stops at max_new_tokens without it loses that
  position (sorted digits without EOS score k / (k + 1)), and a perfect score needs the EOS;
- tokens after the first EOS are ignored: the generator stops there, and the learner's response
  mask ends there too, so they are never trained on;
- an empty response scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titan_learner.job.tasks.base import Task
from titan_learner.job.tasks.vocab import (
    BOS_ID,
    EOS_ID,
    NUM_DIGITS,
    PAD_ID,
    SEP_ID,
    VOCAB_SIZE,
    is_digit,
)
from titan_learner.job.tasks.vocab import decode as decode_ids

MIN_DIGITS = 4
MAX_DIGITS = 6
# the longest right answer (6 digits + EOS) and one token of slack, as in the measured recipe
MAX_NEW_TOKENS = MAX_DIGITS + 2


def sample_prompts(n: int, generator: torch.Generator) -> list[list[int]]:
    """n prompts `BOS d1..dk SEP` with k uniform in [MIN_DIGITS, MAX_DIGITS], seeded by `generator`."""
    if n < 0:
        raise ValueError(f"number of prompts must be >= 0, got {n}")
    lengths = torch.randint(MIN_DIGITS, MAX_DIGITS + 1, (n,), generator=generator).tolist()
    digits = torch.randint(0, NUM_DIGITS, (n, MAX_DIGITS), generator=generator).tolist()
    return [[BOS_ID, *row[:k], SEP_ID] for row, k in zip(digits, lengths, strict=True)]


def prompt_digits(prompt_ids: Sequence[int]) -> list[int]:
    """The digits of a prompt `BOS d1..dk SEP`; a ValueError names what is wrong otherwise."""
    ids = [int(t) for t in prompt_ids]
    if len(ids) < 3 or ids[0] != BOS_ID or ids[-1] != SEP_ID:
        raise ValueError(f"a sort prompt is BOS d1..dk SEP (k >= 1), got {ids}")
    digits = ids[1:-1]
    if not all(is_digit(t) for t in digits):
        raise ValueError(f"a sort prompt holds only digit ids 0-9 between BOS and SEP, got {ids}")
    return digits


def target_completion(prompt_ids: Sequence[int]) -> list[int]:
    """The right answer: the prompt's digits in ascending order, then EOS."""
    return [*sorted(prompt_digits(prompt_ids)), EOS_ID]


def reward(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    """Fraction of response positions right, in [0, 1] (the rules are in the module docstring)."""
    target = target_completion(prompt_ids)
    response = [int(t) for t in completion_ids]
    if EOS_ID in response:
        response = response[: response.index(EOS_ID) + 1]
    right = sum(a == b for a, b in zip(response, target, strict=False))
    return right / max(len(target), len(response))


SORT_TASK = Task(
    name="sort",
    vocab_size=VOCAB_SIZE,
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    max_new_tokens=MAX_NEW_TOKENS,
    sample_prompts=sample_prompts,
    reward=reward,
    decode=decode_ids,
)
