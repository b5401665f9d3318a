"""Completions to rewards, the same way for training and evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from titan_learner.env.episode import Episodes

from titan_learner.data.loader import Prompt
from titan_learner.data.tokenizer import PromptTokenizer
from titan_learner.job.collectives import gather_objects, gather_over, raise_everywhere
from titan_learner.job.episodes import add_env_rewards, answer_texts
from titan_learner.rewards.runner import (
    Reward,
    Scores,
    check_error_fractions,
    score,
    weighted_total,
)


@dataclass
class Scored:
    """A rollout's decoded completions, their prompts, and their scores or the error that
    stopped the rewards: what `score_locally` computes, on this rank alone."""

    texts: list[str]
    owners: list[Prompt]
    scores: Scores | None
    error: Exception | None


def score_locally(
    rollout,
    prompts: Sequence[Prompt],
    group: int,
    tokenizer: PromptTokenizer,
    rewards: Sequence[Reward],
    episodes: Episodes | None = None,
) -> Scored:
    """Decode and score this rank's completions, no collective: the rollout thread calls it
    with `[rollout] max_off_policy_steps > 0`, so that scoring overlaps the update. Of
    `episodes`, the last model turns are scored (job.episodes)."""
    if episodes is not None:
        texts = answer_texts(episodes, tokenizer.decode)
    else:
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
    return Scored(texts, owners, scores, error)


def score_rollout(
    rollout,
    prompts: Sequence[Prompt],
    group: int,
    tokenizer: PromptTokenizer,
    rewards: Sequence[Reward],
    learn: bool = True,
    ahead: Scored | None = None,
    episodes: Episodes | None = None,
) -> tuple[list[str], list[Prompt], Scores | None]:
    """Decode each completion and score it with the rewards; `(texts, owners, scores)`.

    A collective: every rank calls it (`rollout=None` on a rank with no prompts), so that a
    reward that fails on one rank raises on all of them instead of leaving them waiting, and a
    reward's `max_error_fraction` is judged over the completions of every rank. `learn`: the
    running normalizers take in this step's scores (training) or only apply (evaluation).
    `ahead`: the rollout's `score_locally`, already computed in the rollout thread.
    `episodes`: multi-turn, their last turns scored and their environment rewards added.
    """
    scored = ahead or score_locally(rollout, prompts, group, tokenizer, rewards, episodes)
    raise_everywhere(scored.error)
    judge_error_fractions(rewards, scored.scores)
    normalize_scores(rewards, scored.scores, learn)
    if episodes is not None and scored.scores is not None:
        add_env_rewards(scored.scores, episodes)
    return scored.texts, scored.owners, scored.scores


def normalize_scores(rewards: Sequence[Reward], scores: Scores | None, learn: bool) -> None:
    """`normalize = "running"` rewards: update their statistics with every rank's raw scores
    (in rank order: the same statistics everywhere; a collective), then standardize this
    rank's scores and recompute the weighted total."""
    normalized = [r for r in rewards if r.normalizer is not None]
    if not normalized:
        return
    if learn:
        mine = {r.name: scores.per_reward[r.name].tolist() for r in normalized} if scores else {}
        parts = gather_objects(mine, _world())
        for reward in normalized:
            reward.normalizer.update([v for part in parts for v in part.get(reward.name, [])])
    if scores is None:
        return
    for reward in normalized:
        scores.per_reward[reward.name] = reward.normalizer.apply(scores.per_reward[reward.name])
    scores.total = weighted_total(rewards, scores.per_reward, len(scores.total))


def _world():
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def judge_error_fractions(rewards: Sequence[Reward], scores: Scores | None) -> None:
    """Each reward's failures over every rank's completions against its `max_error_fraction`:
    the same verdict on every rank (a collective)."""
    check_error_fractions(rewards, gather_objects(scores.failures if scores else {}, _world()))


def reward_metrics(scores: Scores, group, device) -> dict[str, float]:
    """Per reward: `reward/<name>_s`, the slowest rank's scoring time, and for a reward model
    `reward/<name>_truncated`, the pairs cut to max_length over every rank (a collective)."""
    metrics = {}
    for name, seconds in scores.seconds.items():
        metrics[f"reward/{name}_s"] = float(
            gather_over(torch.tensor([seconds]), group, device).max()
        )
    for name, count in scores.truncated.items():
        metrics[f"reward/{name}_truncated"] = float(
            gather_over(torch.tensor([float(count)]), group, device).sum()
        )
    return metrics
