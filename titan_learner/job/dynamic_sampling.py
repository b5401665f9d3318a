"""DAPO's "dynamic sampling" (`[rollout] dynamic_sampling = true`): no step trains on groups
that cannot teach it.

A group whose G rewards are all equal (all solved, none solved) has zero advantage on every
row: it adds tokens to the loss's mean and no gradient, so the more of them, the weaker the
step. DAPO (Yu et al., 2025, section 3.2; verl's `filter_groups`) drops them and samples more
prompts until the batch is full. Here a round draws the next `prompts_per_step` prompts of
the data (every rank the same, as any step), each rank samples and scores its share, and each
rank keeps its groups with unequal rewards (the rewards the advantage sees, DAPO's overlong
shaping included, the KL penalty not) up to its share of `prompts_per_step`. Rounds go on
until every rank is full, the ranks agreeing through one all-reduce per round, or
`max_sampling_rounds` were sampled: a rank still short then fills its share with the groups
it dropped, as plain GRPO would train them, so every rank trains the same number of groups.
Useful groups beyond a full share are left out (as verl truncates the batch) and counted.

The data moves `prompts_per_step` prompts a round and its position is saved with each
checkpoint, so a resumed run samples what an uninterrupted one did. Reported, over every
rank: the rounds (training/sampling_rounds), the groups left out for equal rewards
(training/groups_dropped) and the useful ones left out of a full share
(training/groups_surplus): no sampled prompt goes untrained unseen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_learner.env.episode import Episodes
from titan_learner.job.reward_shaping import shaped_rewards
from titan_learner.job.rollouts import Rollouts, Taken
from titan_learner.rewards.runner import Scores
from titan_learner.rollout.groups import group_rows, join_rollouts, select_groups

if TYPE_CHECKING:
    from titan_learner.config.schema import Config
    from titan_learner.data.loader import PromptLoader
    from titan_learner.job.sampled import Sampled

Scored = tuple[list[str], list, Scores]
Score = Callable[["Sampled"], Scored]
"""`score(sampled)`: its `score_rollout` (a collective: every rank calls it)."""


@dataclass(frozen=True)
class Group:
    """One group of one round: its rollout and scores, and its index there."""

    sampled: Sampled
    scored: Scored
    index: int


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[P]` bool: the groups whose rewards `[P * G]` are all equal (zero advantage)."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1)


class DynamicSamplingRollouts(Rollouts):
    """Synchronous rollouts (k = 0) of groups with a learning signal, sampled round by round."""

    def __init__(
        self,
        config: Config,
        learner,
        generator,
        loader: PromptLoader,
        sample: Callable[..., Sampled],
        score: Score,
    ) -> None:
        """`sample(prompts, step, attempt)`: this rank's rollout of a round's prompts."""
        super().__init__(learner, generator, loader, sample)
        self.config, self.score = config, score
        self.share = config.rollout.prompts_per_step // learner.capabilities.data_parallel_size

    def take(self, step: int) -> Taken:
        group_size = self.config.rollout.group_size
        start = time.perf_counter()
        kept: list[Group] = []
        dropped: list[Group] = []
        rounds, errors, surplus = 0, 0, 0
        while rounds < self.config.rollout.max_sampling_rounds:
            sampled = self.sample(self.loader.next_step(), step, rounds)
            rounds += 1
            scored = self.score(sampled)
            errors += scored[2].errors
            rewards = shaped_rewards(
                self.config, scored[2].total, sampled.rollout.completion_lengths
            )
            for index, equal in enumerate(equal_reward_groups(rewards, group_size).tolist()):
                group = Group(sampled, scored, index)
                if equal:
                    dropped.append(group)
                elif len(kept) < self.share:
                    kept.append(group)
                else:
                    surplus += 1
            if self._most_missing(self.share - len(kept)) == 0:
                break
        filled = self.share - len(kept)
        kept += dropped[:filled]  # a short share after the last round: as plain GRPO would
        sampled = joined(kept, time.perf_counter() - start, errors)
        sampled.metrics.update(
            sampling_rounds=float(rounds),
            groups_dropped=self._summed(len(dropped) - filled),
            groups_surplus=self._summed(surplus),
        )
        return Taken(step, sampled, self.loader.epoch, step - 1, sampled.seconds)

    def _most_missing(self, missing: int) -> int:
        """The largest number of groups a rank still misses: the same on every rank (a
        collective over the world, so tensor-parallel peers decide alike too)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return missing
        value = torch.tensor([missing], device=self.learner.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def _summed(self, count: int) -> float:
        """`count` summed over the data-parallel ranks."""
        group = self.learner.data_parallel_group
        if group is None:
            return float(count)
        value = torch.tensor([count], device=self.learner.device)
        dist.all_reduce(value, group=group)
        return float(value.item())


def joined(groups: list[Group], seconds: float, errors: int) -> Sampled:
    """One `Sampled` of `groups` (in order), with their prompts and scores; `errors`: the
    reward errors of every round (training/reward_errors counts them all)."""
    from titan_learner.job.sampled import Sampled

    rounds: dict[int, tuple[Group, list[int]]] = {}
    for group in groups:  # by round, each round's groups in order
        rounds.setdefault(id(group.sampled), (group, []))[1].append(group.index)
    rollouts, mine, texts, owners, totals, per_reward = [], [], [], [], [], {}
    messages, episodes = [], []
    for first, indices in rounds.values():
        sampled, (round_texts, round_owners, scores) = first.sampled, first.scored
        size = sampled.rollout.group_size
        rows = group_rows(indices, size).tolist()
        rollouts.append(select_groups(sampled.rollout, indices))
        mine += [sampled.mine[i] for i in indices]
        if sampled.episodes is not None:
            episodes += [sampled.episodes.episodes[r] for r in rows]
        texts += [round_texts[r] for r in rows]
        owners += [round_owners[r] for r in rows]
        totals.append(scores.total[rows])
        for name, values in scores.per_reward.items():
            per_reward.setdefault(name, []).append(values[rows])
        messages += scores.messages
    scores = Scores(
        torch.cat(totals), {k: torch.cat(v) for k, v in per_reward.items()}, errors, messages
    )
    rollout = join_rollouts(rollouts)
    return Sampled(
        rollout,
        mine,
        seconds,
        scored=(texts, owners, scores),
        episodes=Episodes(episodes, rollout) if episodes else None,
    )
