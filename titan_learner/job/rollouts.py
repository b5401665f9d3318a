"""Where each step's rollout comes from: sampled in turn (k = 0) or ahead of the learner (k > 0).

`[rollout] max_off_policy_steps = k`. With k = 0 a step samples, trains, then pushes the new
weights into the generator: every batch is on-policy. With k > 0 a background thread samples
the coming steps from weights at most k versions old while the learner trains
(titan_learner.rollout.pipeline); the loop is the same for both, through `Rollouts`:

    sampled = rollouts.take(step)            # this step's rollout, its staleness
    train_on(..., push=lambda: rollouts.push(step))
    with rollouts.drained(step, sync):       # evaluation, checkpoints: the generator holds
        ...                                  # the weights of `step`, the data is at `step`

A SIGTERM between sync points (k > 0) saves the rollouts already sampled for the coming steps
with the checkpoint (`queued_state()`, each rank its own), and `--resume` trains on them
(`job.rollout_source.make_rollouts(..., queued=...)`): the resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_learner.data.loader import rank_slice
from titan_learner.env.episode import Episodes, to_rollout
from titan_learner.env.episode_record import episodes_from_tensor, episodes_to_tensor
from titan_learner.ranks import rank
from titan_learner.rollout.base import Rollout
from titan_learner.rollout.pipeline import Produced, RolloutPipeline
from titan_learner.weights.sinks import StagingSink, push_weights

if TYPE_CHECKING:
    from titan_learner.config.schema import Config
    from titan_learner.data.loader import PromptLoader
    from titan_learner.job.sampled import Sampled

ROLLOUT_TENSORS = ("completion_tokens", "completion_log_probs", "completion_lengths", "finished")
QUEUED_STEP = re.compile(r"step(\d+)_versions")

Sample = Callable[[list, int], "Sampled"]
"""`sample(prompts, step)`: this rank's rollout of a step's prompts (no collective)."""


@dataclass
class Taken:
    step: int
    sampled: Sampled
    epoch: float
    version: int
    """The policy version that sampled the batch."""
    waited_s: float
    """How long the step waited for it (the whole sampling, when sampled in turn)."""

    @property
    def staleness(self) -> int:
        """Policy versions between the weights that sampled the batch and those it trains."""
        return self.step - 1 - self.version


def sync_points(config: Config) -> Callable[[int], bool]:
    """The steps after which the pipeline drains: checkpoints, evaluations, the last step.
    Fixed by the config, so a resumed run drains where the uninterrupted one did."""
    every, interval, last = config.eval.every_steps, config.checkpoint.interval, config.run.steps

    def is_sync_point(step: int) -> bool:
        return (
            step == last
            or bool(every and step % every == 0)
            or bool(interval and step % interval == 0)
        )

    return is_sync_point


class Rollouts:
    """Synchronous rollouts (k = 0): sample, train, push, in turn."""

    def __init__(self, learner, generator, loader: PromptLoader, sample: Sample) -> None:
        self.learner, self.generator, self.loader, self.sample = learner, generator, loader, sample

    def take(self, step: int) -> Taken:
        sampled = self.sample(self.loader.next_step(), step)
        return Taken(step, sampled, self.loader.epoch, step - 1, sampled.seconds)

    def push(self, step: int) -> None:
        from titan_learner.job.sampled import sync_generator

        sync_generator(self.learner, self.generator)

    @contextmanager
    def drained(self, step: int, sync: bool) -> Iterator[None]:
        yield

    def queued_state(self) -> dict[str, torch.Tensor]:
        """This rank's rollouts sampled for steps not trained yet (none in turn)."""
        return {}

    def close(self, wait: bool = True) -> None:
        pass


class HandoffSink(StagingSink):
    """A verified export, copied (the learner's tensors change at the next update) and handed
    to a callable: the pipeline's thread loads it before the rollout that needs it."""

    def __init__(self, hand_over: Callable[[list, int], None]) -> None:
        super().__init__()
        self.hand_over = hand_over

    def apply(self, named: list, version: int) -> None:
        self.hand_over([(name, tensor.clone()) for name, tensor in named], version)


class OffPolicyRollouts(Rollouts):
    """Rollouts sampled ahead by a thread, at most k policy versions old (k > 0)."""

    def __init__(
        self,
        learner,
        generator,
        loader: PromptLoader,
        sample: Sample,
        *,
        off_policy_steps: int,
        is_sync_point: Callable[[int], bool],
        last_step: int,
        group_size: int,
        queued: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`queued`: what `queued_state()` saved at a preemption, to train on first."""
        super().__init__(learner, generator, loader, sample)
        self.group_size = group_size
        # On CPU the sampling thread takes half the cores' threads; the learner keeps its own
        # (it is the longer phase: it has every core whenever the generator waits).
        self._threads = (
            max(1, torch.get_num_threads() // 2) if learner.device.type == "cpu" else None
        )
        self._before: dict[int, dict[str, int]] = {}  # step -> data position before its prompts
        self._epochs: dict[int, float] = {}
        self.is_sync_point = is_sync_point
        self.pipeline = RolloutPipeline(
            self._produce,
            generator.load_weights,
            off_policy_steps=off_policy_steps,
            is_sync_point=is_sync_point,
            start=learner.step,
            last_step=last_step,
            queued=self._restore(queued or {}),
        )

    def _produce(self, step: int) -> Sampled:
        """In the pipeline's thread: the step's prompts (the data moves only here) and rollout."""
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # per thread, for OpenMP
        self._before[step] = self.loader.state_dict()
        prompts = self.loader.next_step()
        self._epochs[step] = self.loader.epoch
        return self.sample(prompts, step)

    def take(self, step: int) -> Taken:
        start = time.perf_counter()
        produced = self.pipeline.take(step)
        waited = time.perf_counter() - start
        self._before.pop(step, None)
        return Taken(step, produced.value, self._epochs.pop(step), produced.version, waited)

    def push(self, step: int) -> None:
        """After the update of `step`: its weights to the thread, unless the pipeline drains
        here (then `drained` loads them straight into the parked generator)."""
        if self.is_sync_point(step):
            return
        from titan_learner.job.sampled import BUCKET_BYTES

        sink = HandoffSink(lambda named, _: self.pipeline.publish(step, named))
        adapters = getattr(self.generator, "takes_adapters", False)
        push_weights(
            self.learner,
            sink,
            BUCKET_BYTES,
            cpu_offload=False,
            checksum=False,
            adapters=adapters,
        )

    @contextmanager
    def drained(self, step: int, sync: bool) -> Iterator[None]:
        """At a sync point (or a preemption): the thread parked, the generator holding the
        weights of `step`, the data at `step`; the thread resumes after the block."""
        if not sync:
            yield
            return
        from titan_learner.job.sampled import sync_generator

        self.pipeline.parked()
        if not self.is_sync_point(step):  # a preemption: the thread may be a step ahead
            self.loader.load_state_dict(self._before.get(step + 1, self.loader.state_dict()))
        sync_generator(self.learner, self.generator)
        yield
        self.pipeline.mark_loaded(step)

    def close(self, wait: bool = True) -> None:
        self.pipeline.close(wait)

    def _layout(self) -> torch.Tensor:
        """What queued rollouts depend on: this rank's share of a step's prompts, G."""
        learner = self.learner
        return torch.tensor(
            [
                learner.data_parallel_rank,
                learner.capabilities.data_parallel_size,
                self.loader.per_step,
                self.group_size,
            ]
        )

    def queued_state(self) -> dict[str, torch.Tensor]:
        """After `drained` at a preemption: the rollouts the parked thread made for the coming
        steps (with their versions), to be saved with the checkpoint; the data position the
        checkpoint keeps is before their prompts, which a resume draws again."""
        state = {}
        for produced in self.pipeline.queued():
            rollout: Rollout = produced.value.rollout
            tag = f"step{produced.step}"
            state |= {
                f"{tag}_versions": torch.tensor(
                    [produced.version, rollout.weights_version, rollout.pad_id]
                ),
                f"{tag}_seconds": torch.tensor([produced.value.seconds], dtype=torch.float64),
                **{f"{tag}_{name}": getattr(rollout, name).cpu() for name in ROLLOUT_TENSORS},
            }
            if produced.value.episodes is not None:  # multi-turn: the episodes themselves
                state[f"{tag}_episodes"] = episodes_to_tensor(produced.value.episodes)
        return state | {"layout": self._layout()} if state else {}

    def _restore(self, queued: dict[str, torch.Tensor]) -> list[Produced]:
        """The saved rollouts, with the prompts they answer drawn again from the data; none
        (they are sampled again, on-policy) when the data-parallel layout changed."""
        from titan_learner.job.sampled import Sampled

        if not queued:
            return []
        if not torch.equal(queued["layout"], self._layout()):
            if rank() == 0:
                print(
                    "the checkpoint's queued rollouts were sampled for another data-parallel "
                    "layout: sampling those steps again (the run goes on, not step-for-step "
                    "like an uninterrupted one)",
                    flush=True,
                )
            return []
        steps = sorted(int(m[1]) for m in map(QUEUED_STEP.fullmatch, queued) if m)
        restored = []
        for step in steps:
            tag = f"step{step}"
            version, weights_version, pad_id = queued[f"{tag}_versions"].tolist()
            self._before[step] = self.loader.state_dict()
            mine = rank_slice(
                self.loader.next_step(),
                self.learner.data_parallel_rank,
                self.learner.capabilities.data_parallel_size,
            )
            self._epochs[step] = self.loader.epoch
            seconds = float(queued[f"{tag}_seconds"])
            saved, episodes = queued.get(f"{tag}_episodes"), None
            if saved is None:
                rollout = Rollout(
                    prompts=[prompt.ids for prompt in mine],
                    group_size=self.group_size,
                    pad_id=pad_id,
                    weights_version=weights_version,
                    **{name: queued[f"{tag}_{name}"] for name in ROLLOUT_TENSORS},
                )
            else:  # multi-turn: the rollout as the episodes made it (their prompts, mask)
                ended = episodes_from_tensor(saved)
                rollout = to_rollout(ended, self.group_size, pad_id, weights_version)
                episodes = Episodes(ended, rollout)
            restored.append(
                Produced(step, version, Sampled(rollout, mine, seconds, episodes=episodes))
            )
        return restored
