"""The embedded default's files (configs/toy) for tests: its tokenizer ids, prompts and reward."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy"
VOCAB_SIZE, PAD_ID, BOS_ID, SEP_ID, EOS_ID = 14, 10, 11, 12, 13
MAX_NEW = 8  # the longest right answer (6 digits + <eos>) and one token of slack


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOY / "tokenizer"), local_files_only=True)


@functools.cache
def reward_module():
    spec = importlib.util.spec_from_file_location("toy_sort_reward", TOY / "sort_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_prompts(n: int, generator: torch.Generator) -> list[list[int]]:
    """n prompts `<bos> d1..dk <sep>` with k uniform in 4..6, seeded by `generator`."""
    lengths = torch.randint(4, 7, (n,), generator=generator).tolist()
    digits = torch.randint(0, 10, (n, 6), generator=generator).tolist()
    return [[BOS_ID, *row[:k], SEP_ID] for row, k in zip(digits, lengths, strict=True)]


def reward_of_ids(prompt_ids: list[int], completion_ids: list[int]) -> float:
    """The toy reward of token ids, as the job computes it from decoded text."""
    digits = "".join(str(t) for t in prompt_ids if t < 10)
    completion = tokenizer().decode(completion_ids, skip_special_tokens=False)
    return reward_module().score(digits, completion, {"answer": "".join(sorted(digits))})


def rewards_of(rollout) -> torch.Tensor:
    """`[N]` toy rewards of a Rollout's rows."""
    g = rollout.group_size
    values = [
        reward_of_ids(rollout.prompts[i // g], ids) for i, ids in enumerate(rollout.completion_ids)
    ]
    return torch.tensor(values, dtype=torch.float32)
