"""The sort task: its vocabulary, prompt sampler, reward and registry."""

from __future__ import annotations

import pytest
import torch

from titan_learner.job.tasks.base import Task
from titan_learner.job.tasks.registry import TASKS, get_task
from titan_learner.job.tasks.sort_digits import (
    MAX_DIGITS,
    MIN_DIGITS,
    reward,
    sample_prompts,
    target_completion,
)
from titan_learner.job.tasks.vocab import BOS_ID, EOS_ID, PAD_ID, SEP_ID, VOCAB_SIZE, decode, encode

PROMPT = [BOS_ID, 4, 2, 3, 1, 0, SEP_ID]  # k = 5: target 0 1 2 3 4 EOS, 6 positions


def test_vocabulary_has_fourteen_distinct_ids():
    ids = {*range(10), PAD_ID, BOS_ID, SEP_ID, EOS_ID}
    assert VOCAB_SIZE == 14 and ids == set(range(VOCAB_SIZE))


def test_tokenizer_round_trip():
    ids = [BOS_ID, 3, 0, 9, SEP_ID, 0, 3, 9, EOS_ID, PAD_ID]
    assert decode(ids) == "<bos>309<sep>039<eos><pad>"
    assert encode(decode(ids)) == ids
    every = list(range(VOCAB_SIZE))
    assert encode(decode(every)) == every


def test_tokenizer_errors_are_clear():
    with pytest.raises(ValueError, match="outside the digit vocabulary"):
        decode([14])
    with pytest.raises(ValueError, match="expected a digit or one of"):
        encode("12<cls>")


def test_reward_hand_cases():
    assert target_completion(PROMPT) == [0, 1, 2, 3, 4, EOS_ID]
    assert reward(PROMPT, [0, 1, 2, 3, 4, EOS_ID]) == 1.0  # perfect
    assert reward(PROMPT, [0, 1, 2, 9, 9, 9]) == 0.5  # half right: 3 of 6, no EOS
    assert reward(PROMPT, [0, 1, 2, 4, 3, 4]) == 0.5  # 3 of 6
    assert reward(PROMPT, []) == 0.0  # empty
    assert reward(PROMPT, [EOS_ID]) == 0.0  # stops at once
    assert reward(PROMPT, [0, 1, 2, 3, 4]) == pytest.approx(5 / 6)  # missing EOS
    # extra tokens before EOS widen the denominator: 5 right of 7 positions
    assert reward(PROMPT, [0, 1, 2, 3, 4, 4, EOS_ID]) == pytest.approx(5 / 7)
    # tokens after the first EOS are ignored (the generator stops there)
    assert reward(PROMPT, [0, 1, 2, 3, 4, EOS_ID, 7, 7]) == 1.0
    # an early EOS is wrong where a digit belongs and ends the response
    assert reward(PROMPT, [0, 1, EOS_ID, 2, 3, 4]) == pytest.approx(2 / 6)


def test_reward_rejects_malformed_prompts():
    for bad in ([4, 2, SEP_ID], [BOS_ID, 4, 2], [BOS_ID, SEP_ID], [BOS_ID, 4, EOS_ID, SEP_ID]):
        with pytest.raises(ValueError, match="sort prompt"):
            reward(bad, [EOS_ID])


def test_prompt_sampler_is_seeded_and_well_formed():
    a = sample_prompts(200, torch.Generator().manual_seed(3))
    b = sample_prompts(200, torch.Generator().manual_seed(3))
    c = sample_prompts(200, torch.Generator().manual_seed(4))
    assert a == b and a != c
    lengths = {len(p) - 2 for p in a}
    assert lengths == set(range(MIN_DIGITS, MAX_DIGITS + 1))
    for prompt in a:
        assert prompt[0] == BOS_ID and prompt[-1] == SEP_ID
        assert all(0 <= d <= 9 for d in prompt[1:-1])
    assert sample_prompts(0, torch.Generator()) == []


def test_registry():
    task = get_task("sort")
    assert isinstance(task, Task) and TASKS["sort"] is task
    assert (task.vocab_size, task.pad_id, task.eos_id) == (14, PAD_ID, EOS_ID)
    assert task.max_new_tokens >= MAX_DIGITS + 1  # room for the longest answer and its EOS
    assert task.decode(PROMPT) == "<bos>42310<sep>"
    with pytest.raises(ValueError, match="unknown task 'sorting'; allowed tasks: sort"):
        get_task("sorting")
