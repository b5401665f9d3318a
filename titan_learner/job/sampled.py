"""What the loop's parts share: one step's sample on a rank, and the embedded generator's
weight sync (the step in job.grpo, the pipeline in job.rollouts and DAPO's rounds in
job.dynamic_sampling all use them; none of them imports another for these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_learner.data.loader import Prompt
    from titan_learner.env.episode import Episodes
    from titan_learner.job.scoring import Scored
    from titan_learner.rewards.runner import Scores
    from titan_learner.rollout.base import Rollout

BUCKET_BYTES = 64 * 1024**2


@dataclass
class Sampled:
    """One step's rollout on this rank, and the prompts it answers.

    `scored`: its `score_rollout` result when the sampling already scored it (dynamic
    sampling); `metrics`: what the sampling reports for the step."""

    rollout: Rollout
    mine: list[Prompt]
    seconds: float
    scored: tuple[list[str], list[Prompt], Scores] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    ahead: Scored | None = None
    """Its rewards on this rank alone, computed in the rollout thread when it samples ahead
    (`job.scoring.score_locally`); the step's collectives still run on them."""
    episodes: Episodes | None = None
    """Multi-turn ([env], [[tool]]): the episodes the rollout holds (job.episodes)."""


def sync_generator(learner, generator) -> None:
    """Every rank's embedded generator takes the learner's full weights (a collective).

    The tensors never leave the process, so the manifest's names and shapes are checked but the
    bytes are not hashed (on GPU that would copy the whole model to the host every step).
    Servers on nccl_m2n (`local_shards`) take each rank's own shards instead: no gather.
    """
    from titan_learner.weights.sinks import GeneratorSink, push_weights

    shards = getattr(generator, "local_shards", None)
    if shards is not None:
        generator.load_weights(shards, learner.policy_version)
        return
    adapters = getattr(generator, "takes_adapters", False)  # a LoRA run's, to vLLM engines
    push_weights(
        learner,
        GeneratorSink(generator),
        BUCKET_BYTES,
        cpu_offload=False,
        checksum=False,
        adapters=adapters,
    )
