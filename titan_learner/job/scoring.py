"""Completions to rewards, the same way for training and evaluation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from titan_learner.data.loader import Prompt
from titan_learner.data.tokenizer import PromptTokenizer
from titan_learner.job.collectives import gather_objects, gather_over, raise_everywhere
from titan_learner.rewards.runner import Reward, Scores, check_error_fractions, score


def score_rollout(
    rollout,
    prompts: Sequence[Prompt],
    group: int,
    tokenizer: PromptTokenizer,
    rewards: Sequence[Reward],
) -> tuple[list[str], list[Prompt], Scores | None]:
    """Decode each completion and score it with the rewards; `(texts, owners, scores)`.

    A collective: every rank calls it (`rollout=None` on a rank with no prompts), so that a
    reward that fails on one rank raises on all of them instead of leaving them waiting, and a
    reward's `max_error_fraction` is judged over the completions of every rank.
    """
    texts = [tokenizer.decode(ids) for ids in rollout.completion_ids] if rollout else []
    owners = [p for p in prompts for _ in range(group)] if rollout else []
    scores, error = None, None
    if rollout is not None:
        try:
            scores = score(
                rewards,
                [p.text for p in owners],
                texts,
                [p.row for p in owners],
                [p.origin for p in owners],
            )
        except Exception as err:  # every rank must learn of it before the next collective
            error = err
    raise_everywhere(error)
    judge_error_fractions(rewards, scores)
    return texts, owners, scores


def judge_error_fractions(rewards: Sequence[Reward], scores: Scores | None) -> None:
    """Each reward's failures over every rank's completions against its `max_error_fraction`:
    the same verdict on every rank (a collective)."""
    world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    check_error_fractions(rewards, gather_objects(scores.failures if scores else {}, world))


def reward_metrics(scores: Scores, group, device) -> dict[str, float]:
    """Per reward: `reward/<name>_s`, the slowest rank's scoring time (a collective)."""
    return {
        f"reward/{name}_s": float(gather_over(torch.tensor([seconds]), group, device).max())
        for name, seconds in scores.seconds.items()
    }
