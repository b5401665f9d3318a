"""Rollouts produced ahead of the learner, from weights at most k policy versions old.

With `[rollout] max_off_policy_steps = k > 0`, a background thread owns the generator: while
the learner updates on step t's rollout, the thread already samples step t+1's (and, for
k > 1, further ones). Which weights each rollout uses is fixed in advance, so a run is
reproducible and resumable exactly:

    version(t) = max(t - 1 - k, the last sync point before t)

where the learner holds version j after its j-th update and the sync points are the steps
after which the pipeline drains: the run's start (step 0 or the resumed step), every
checkpoint, every evaluation. After a sync point s the next rollout is on-policy (version s),
so what a checkpoint at s saves (the learner and the data position) is all the run needs: the
thread is parked, waiting for version s, and has drawn no prompt beyond step s. The sync
points are known in advance (the config's intervals), never decided by timing. A batch is
never older than k versions; the staleness of each step, `t - 1 - version(t)`, is reported.

A preemption (SIGTERM) can stop the run between sync points: the thread then finishes every
rollout it has weights for (those of versions up to the learner's), the checkpoint keeps them
(`queued()`), and the resumed pipeline starts with them (`queued=`): its next rollout needs
a version the learner has not reached yet, so the schedule above goes on as if never stopped.

Weights reach the thread as named tensors the learner exported (copies): the thread loads a
version into the generator just before the rollout that needs it, so the generator is only
ever touched by one thread, and generation stops only for that copy. A generator that fails
in the thread ends the job with its error at the next step, not with a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]
WAIT_S = 1.0
"""How often a waiting side checks whether the other one failed or closed."""


def rollout_version(
    step: int, off_policy_steps: int, start: int, is_sync_point: Callable[[int], bool]
) -> int:
    """The policy version step `step`'s rollout is sampled from (see the module docstring)."""
    oldest = max(step - 1 - off_policy_steps, start)
    return next((s for s in range(step - 1, oldest, -1) if is_sync_point(s)), oldest)


def stale_versions_after(
    step: int,
    off_policy_steps: int,
    start: int,
    is_sync_point: Callable[[int], bool],
    last_step: int,
) -> set[int]:
    """The versions the stale steps after `step` (up to `last_step`) are sampled from, among
    those the learner holds before the update of `step` or held earlier: only steps up to
    step + k can be sampled from one of them."""
    needed = set()
    for later in range(step + 1, min(step + off_policy_steps, last_step) + 1):
        version = rollout_version(later, off_policy_steps, start, is_sync_point)
        if version < later - 1:
            needed.add(version)
    return needed


class GeneratorFailed(RuntimeError):
    """The rollout generator raised in its thread; the original error is the cause."""


@dataclass
class Produced:
    """One step's rollout and what it was made from."""

    step: int
    version: int
    value: Any


class RolloutPipeline:
    """A thread that runs `produce(step)` for each step, in order, `k` versions ahead at most.

    `produce(step)` samples step `step`'s rollout with the generator (it draws the step's
    prompts itself, so the data position only moves in this thread). Versions are the
    learner's step count: version j are the weights after step j. The learner's side:
    `take(step)` waits for a step's rollout; `publish(version, weights)` hands over the
    weights after a step; at a sync point, `parked()` waits until the thread is idle (waiting
    for that version), the caller may then use the generator itself and `mark_loaded(version)`.
    """

    def __init__(
        self,
        produce: Callable[[int], Any],
        load_weights: Callable[[NamedTensors, int], None],
        *,
        off_policy_steps: int,
        is_sync_point: Callable[[int], bool],
        start: int,
        last_step: int,
        queued: Iterable[Produced] = (),
    ) -> None:
        """`start`: the learner's step now (the generator holds its weights); the thread
        produces steps start + 1 .. last_step, after the `queued` rollouts a preempted run
        saved (steps start + 1, start + 2, ...)."""
        if off_policy_steps < 1:
            raise ValueError(f"off_policy_steps must be >= 1, got {off_policy_steps}")
        done = {produced.step: produced for produced in queued}
        if sorted(done) != list(range(start + 1, start + 1 + len(done))):
            raise ValueError(
                f"queued rollouts must be of steps {start + 1}, ...; got {sorted(done)}"
            )
        self._produce = produce
        self._load = load_weights
        self._k = off_policy_steps
        self._is_sync_point = is_sync_point
        self._start = start
        self._last_step = last_step
        self._loaded = start  # the version the generator holds
        self._weights: dict[int, NamedTensors | None] = {}
        self._done: dict[int, Produced] = done
        self._error: BaseException | None = None
        self._closed = False
        self._waiting_for: int | None = None
        self._next_step = start + 1 + len(done)
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
        self._thread.start()

    # -- the learner's side ------------------------------------------------------------------

    def take(self, step: int) -> Produced:
        """Step `step`'s rollout, once the thread has produced it."""
        with self._changed:
            while step not in self._done:
                self._raise_if_failed()
                self._changed.wait(WAIT_S)
            return self._done.pop(step)

    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """The weights of policy `version` (None: the generator already holds them)."""
        named = None if weights is None else list(weights)
        with self._changed:
            self._weights[version] = named
            self._changed.notify_all()

    def parked(self) -> None:
        """Wait until the thread waits for weights: the generator and the data are free."""
        with self._changed:
            while self._waiting_for is None and self._next_step <= self._last_step:
                self._raise_if_failed()
                self._changed.wait(WAIT_S)

    def queued(self) -> list[Produced]:
        """The rollouts produced and not yet taken, by step (call it when `parked()`)."""
        with self._changed:
            return [self._done[step] for step in sorted(self._done)]

    def mark_loaded(self, version: int) -> None:
        """The caller loaded `version` into the generator itself (while the thread was parked)."""
        with self._changed:
            self._loaded = version
            self._changed.notify_all()

    def close(self, wait: bool = True) -> None:
        """Stop after the rollout in flight; wait=False returns at once (the thread is a daemon:
        an error or an interrupt must not wait for a rollout nobody will train on)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if wait:
            self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise GeneratorFailed(
                f"the rollout generator failed in its thread: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    step = self._next_step
                    if step > self._last_step or self._closed:
                        return
                weights = self._weights_for(step)
                if weights is None:
                    return  # closed while waiting
                version, named = weights
                if named is not None:
                    self._load(named, version)
                value = self._produce(step)
                with self._changed:
                    self._loaded = version
                    self._done[step] = Produced(step, version, value)
                    self._next_step = step + 1
                    self._changed.notify_all()
        except BaseException as err:  # reported to the learner's side by take()/parked()
            with self._changed:
                self._error = err
                self._changed.notify_all()

    def _weights_for(self, step: int) -> tuple[int, NamedTensors | None] | None:
        """Wait for the version `step` needs; (version, weights to load or None if loaded)."""
        with self._changed:
            while True:
                needed = rollout_version(step, self._k, self._start, self._is_sync_point)
                if needed == self._loaded:
                    self._forget_below(needed)
                    self._waiting_for = None
                    return needed, None
                if needed in self._weights:
                    named = self._weights[needed]
                    self._forget_below(needed + 1)
                    self._waiting_for = None
                    return needed, named
                if self._closed:
                    return None
                self._waiting_for = needed
                self._changed.notify_all()
                self._changed.wait(WAIT_S)

    def _forget_below(self, version: int) -> None:
        for old in [v for v in self._weights if v < version]:
            del self._weights[old]
