"""Which source of rollouts a config gets: on-policy, sampled ahead in a thread, or DAPO's
rounds of dynamic sampling (each in its own module, none importing another)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from titan_learner.job.dynamic_sampling import DynamicSamplingRollouts
from titan_learner.job.rollouts import OffPolicyRollouts, Rollouts, Sample, sync_points

if TYPE_CHECKING:
    import torch

    from titan_learner.config.schema import Config
    from titan_learner.data.loader import PromptLoader


def make_rollouts(
    config: Config,
    learner,
    generator,
    loader: PromptLoader,
    sample: Sample,
    queued: dict[str, torch.Tensor] | None = None,
    score: Callable | None = None,
):
    """`queued`: a preempted run's saved rollouts (`queued_state()`), trained on first.
    `score(sampled)`: its rewards, for `[rollout] dynamic_sampling` (job.dynamic_sampling)."""
    k = config.rollout.max_off_policy_steps
    if config.rollout.dynamic_sampling:  # k = 0: validate refuses it sampled ahead
        return DynamicSamplingRollouts(config, learner, generator, loader, sample, score)
    if k == 0:
        return Rollouts(learner, generator, loader, sample)
    return OffPolicyRollouts(
        learner,
        generator,
        loader,
        sample,
        off_policy_steps=k,
        is_sync_point=sync_points(config),
        last_step=config.run.steps,
        group_size=config.rollout.group_size,
        queued=queued,
    )
