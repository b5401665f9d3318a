"""DAPO's handling of completions cut at `max_new_tokens`: a length penalty in the reward and,
optionally, no loss on them at all.

A truncated completion never reached its answer, so its reward says little about its tokens.
DAPO (Yu et al., 2025, section 3.4) offers two remedies, both here:
- "overlong reward shaping" / "soft overlong punishment" (`[rollout] overlong_buffer = N`,
  `overlong_penalty = p`, verl's `overlong_buffer`): with L_max = max_new_tokens, a completion
  of |y| tokens gets

      0                                    if |y| <= L_max - N
      (L_max - N - |y|) / N * p            if L_max - N < |y| <= L_max

  added to its reward, before the group advantage (and before dynamic sampling looks at it);
- "overlong filtering" (`[loss] mask_truncated = true`): completions cut at L_max (no EOS)
  train no token. They stay in the batch and their group's advantage: only the loss skips
  them, through the learner's trained mask (response positions with a finite behaviour
  log-prob, titan_learner.learner.batch.trained_mask).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase

from titan_learner.config.schema import Config
from titan_learner.learner.batch import LOG_PROBS_KEY


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """`[N]` float32, <= 0: DAPO's soft overlong punishment of completions of `lengths` tokens
    (EOS included, as verl counts a response); zeros when `buffer` is 0."""
    lengths = lengths.float()
    if not buffer:
        return torch.zeros_like(lengths)
    over = (lengths - (max_new_tokens - buffer)).clamp(min=0)
    return -over / buffer * penalty


def shaped_rewards(config: Config, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[N]` float32: the configured rewards plus the overlong penalty of `[rollout]`."""
    rollout = config.rollout
    penalty = overlong_penalty(
        lengths, rollout.max_new_tokens, rollout.overlong_buffer, rollout.overlong_penalty
    )
    return rewards.float() + penalty


def without_truncated(batch: TensorDictBase, finished: torch.Tensor) -> TensorDictBase:
    """The batch with no trained token on rows that did not finish (their behaviour log-probs
    NaN); a shallow copy, `batch` itself unchanged."""
    truncated = ~finished.to(torch.bool).reshape(-1, 1)
    out = batch.clone(recurse=False)
    out.set(LOG_PROBS_KEY, batch.get(LOG_PROBS_KEY).masked_fill(truncated, math.nan))
    return out
