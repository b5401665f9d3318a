"""Scoring completions with the configured rewards: weighted sum, timeouts, one-line errors.

Each reward runs over a step's completions in a daemon thread, one completion after another,
and each call gets `timeout_s`: a call that hangs is abandoned (the thread is left behind, the
rest of the batch continues in a new one), so a hung reward can end the job or score 0 but never
hang it. A call that raises, times out, or returns something that is not a finite number is an
error: with `on_error = "raise"` the job stops with one line naming the reward, the dataset row
and what happened; with "zero" the completion scores 0 for that reward and the error is counted,
unless more than `max_error_fraction` of a step's completions (over every rank,
`check_error_fractions`) fail: a reward broken on every row stops the job too, with its count
and first error.

With `workers` > 0 (the default) a function runs over a pool of processes instead
(rewards.pool), where a call that overruns its timeout is stopped by killing its worker; a
function that cannot be pickled stays in this process, said once when the rewards are built.
A reward model (rewards.reward_model) scores a whole step in batches, without per-call timeouts.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titan_learner.config.schema import Config, RewardSection
from titan_learner.rewards.builtins import BUILTINS, builtin
from titan_learner.rewards.judge import Judge, judge_settings
from titan_learner.rewards.loading import load_function
from titan_learner.rewards.normalize import RunningNorm
from titan_learner.rewards.pool import RewardPool, picklable
from titan_learner.rewards.reward_model import RewardModel, model_device

_POLL_S = 0.01


class RewardError(RuntimeError):
    """A reward that raised, hung or returned a non-number, with on_error = "raise"."""


@dataclass(frozen=True)
class Reward:
    """One configured reward: a `function` (in this process, or over a `pool` of processes)
    or a reward `model`; its scores standardized by `normalizer` where configured."""

    name: str
    spec: str
    function: Callable[[str, str, dict], float] | None
    weight: float
    timeout_s: float
    on_error: str
    max_error_fraction: float = 0.5
    pool: RewardPool | None = None
    model: RewardModel | None = None
    judge: Judge | None = None
    normalizer: RunningNorm | None = None


@dataclass(frozen=True)
class Failures:
    """One reward's failures among `scored` completions, and the first one's message."""

    count: int
    scored: int
    first: str | None


@dataclass
class Scores:
    """`total[i]`: completion i's weighted reward; `per_reward[name][i]`: one reward's score;
    `failures[name]`: what failed with on_error = "zero" (`check_error_fractions` judges it)."""

    total: torch.Tensor
    per_reward: dict[str, torch.Tensor]
    errors: int
    messages: list[str] = field(default_factory=list)
    failures: dict[str, Failures] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    """Reward models only: pairs cut to max_length."""
    replies: dict[str, list[str | None]] = field(default_factory=dict)
    """Judges only: each completion's raw reply (None: no reply)."""


def reward_name(section: RewardSection) -> str:
    if section.name:
        return section.name
    if section.model:
        return Path(section.model).name
    if section.judge:
        return "judge"
    if section.function in BUILTINS:
        return section.function
    return section.function.rpartition(":")[2]


def default_workers() -> int:
    return min(8, len(os.sched_getaffinity(0)))


def build_rewards(config: Config, say: Callable[[str], None] = print) -> list[Reward]:
    """The configured rewards, loaded (user functions imported, reward models on their
    device) and ready to run; worker processes start on first use. `say` tells of a function
    that stays in this process."""
    base_dir = Path(config.source).parent
    rewards = []
    for section in config.reward:
        name = reward_name(section)
        spec, scorer = _scorer(config, section, name, base_dir, say)
        rewards.append(
            Reward(
                name=name,
                spec=spec,
                weight=section.weight,
                timeout_s=section.timeout_s,
                on_error=section.on_error,
                max_error_fraction=section.max_error_fraction,
                normalizer=RunningNorm() if section.normalize == "running" else None,
                **scorer,
            )
        )
    return rewards


def _scorer(
    config: Config, section: RewardSection, name: str, base_dir: Path, say: Callable[[str], None]
) -> tuple[str, dict[str, Any]]:
    """What scores one [[reward]] (its spec, and the Reward fields of its kind): a reward
    model, a judge, or a function (built-in or the user's), over worker processes."""
    from titan_learner.config.validate import device_type

    if section.model:
        path = Path(section.model)
        model = RewardModel(
            path if path.is_absolute() else base_dir / path,
            model_device(section.device, device_type(config)),
            section.dtype,
            section.batch_size,
            section.max_length,
        )
        return section.model, {"function": None, "model": model}
    if section.judge:
        settings = judge_settings(section.judge)
        judge = Judge(settings, base_dir, config.data.answer_key)
        return f"judge {settings.model} at {settings.base_url}", {"function": None, "judge": judge}
    if section.function in BUILTINS:
        function = builtin(
            section.function,
            answer_key=config.data.answer_key,
            pattern=section.pattern,
            mode=section.mode,
            credit=section.credit,
        )
    else:
        function = load_function(section.function, base_dir)
    workers = default_workers() if section.workers is None else section.workers
    if workers and not picklable(function):
        say(
            f"reward '{name}' ({section.function}) cannot be pickled for worker processes: "
            "it runs in this process, one completion at a time"
        )
        workers = 0
    pool = RewardPool(function, workers, name) if workers else None
    return section.function, {"function": function, "pool": pool}


def close_rewards(rewards: Sequence[Reward]) -> None:
    """Stop the rewards' worker processes (a later `score` would start them again)."""
    for reward in rewards:
        if reward.pool is not None:
            reward.pool.close()


class _Batch:
    """One reward over items[start:], in a worker thread; abandoned if a call hangs."""

    def __init__(self, function: Callable, items: Sequence[tuple], start: int) -> None:
        self.function = function
        self.items = items
        self.index = start
        self.started = time.monotonic()
        self.results: dict[int, tuple[str, object]] = {}

    def run(self) -> None:
        for index in range(self.index, len(self.items)):
            self.index, self.started = index, time.monotonic()
            try:
                self.results[index] = ("ok", self.function(*self.items[index]))
            except Exception as err:
                self.results[index] = ("raised", f"{type(err).__name__}: {err}")
        self.index = len(self.items)


def _run(reward: Reward, items: Sequence[tuple]) -> dict[int, tuple[str, object]]:
    results: dict[int, tuple[str, object]] = {}
    start = 0
    while start < len(items):
        batch = _Batch(reward.function, items, start)
        thread = threading.Thread(target=batch.run, daemon=True, name=f"reward-{reward.name}")
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            hung = batch.index
            if thread.is_alive() and time.monotonic() - batch.started > reward.timeout_s:
                results.update(batch.results)
                results[hung] = ("timed out", f"no result after {reward.timeout_s:g} s")
                start = hung + 1
                break
        else:
            results.update(batch.results)
            start = len(items)
    return results


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[dict],
    origins: Sequence[str],
) -> Scores:
    """Every reward on every completion; `origins[i]` names completion i's dataset row."""
    items = list(zip(prompts, completions, rows, strict=True))
    per_reward: dict[str, torch.Tensor] = {}
    errors, messages, failures, seconds, truncated, replies = 0, [], {}, {}, {}, {}
    for reward in rewards:
        started = time.perf_counter()
        if reward.model is not None:
            scored = reward.model.score(prompts, completions)
            per_reward[reward.name] = torch.tensor(scored.values, dtype=torch.float32)
            truncated[reward.name] = scored.truncated
            seconds[reward.name] = time.perf_counter() - started
            continue
        values = torch.zeros(len(items), dtype=torch.float32)
        named, failed = f"reward '{reward.name}' ({reward.spec})", []
        if reward.judge is not None:
            outcomes, replies[reward.name] = reward.judge.run(items, reward.timeout_s)
        elif reward.pool is not None:
            outcomes = reward.pool.run(items, reward.timeout_s)
        else:
            outcomes = _run(reward, items)
        for index, (status, value) in sorted(outcomes.items()):
            problem = _problem(status, value)
            if problem is None:
                values[index] = float(value)  # type: ignore[arg-type]
                continue
            message = f"{named} {problem} on {origins[index]}"
            if reward.on_error == "raise":
                raise RewardError(message + '; allowed: a finite number (or on_error = "zero")')
            failed.append(message)
        failures[reward.name] = Failures(len(failed), len(items), failed[0] if failed else None)
        errors += len(failed)
        messages += failed
        per_reward[reward.name] = values
        seconds[reward.name] = time.perf_counter() - started
    total = weighted_total(rewards, per_reward, len(items))
    return Scores(total, per_reward, errors, messages, failures, seconds, truncated, replies)


def weighted_total(
    rewards: Sequence[Reward], per_reward: dict[str, torch.Tensor], count: int
) -> torch.Tensor:
    total = torch.zeros(count, dtype=torch.float32)
    for reward in rewards:
        total += reward.weight * per_reward[reward.name]
    return total


def check_error_fractions(rewards: Sequence[Reward], parts: Sequence[dict[str, Failures]]) -> None:
    """Raise RewardError for the first reward that failed on more than its
    `max_error_fraction` of the completions of all `parts` (a step's, one part per rank)."""
    for reward in rewards:
        mine = [part[reward.name] for part in parts if reward.name in part]
        failed, scored = sum(p.count for p in mine), sum(p.scored for p in mine)
        if failed > reward.max_error_fraction * scored:
            first = next(p.first for p in mine if p.first is not None)
            named = f"reward '{reward.name}' ({reward.spec})"
            raise RewardError(
                f"{named} failed on {failed} of {scored} completions, more than "
                f"max_error_fraction = {reward.max_error_fraction:g} (fix the reward, or raise "
                "it); the first: " + first.removeprefix(named + " ")
            )


def _problem(status: str, value: object) -> str | None:
    if status != "ok":
        return f"{status} ({value})" if status == "raised" else f"{status}: {value}"
    if not isinstance(value, numbers.Real):  # bools are numbers: True scores 1
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {float(value)}, not a finite number"
    return None


def reward_state(
    rewards: Sequence[Reward], names: Collection[str] | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """The running normalizers' statistics (of the rewards `names`, when given), for the
    checkpoint's `extra`; nothing without one, so checkpoints of runs without them keep their
    layout."""
    state = {
        r.name: r.normalizer.state_dict()
        for r in rewards
        if r.normalizer is not None and (names is None or r.name in names)
    }
    return {"reward_normalizers": state} if state else {}


def load_reward_state(rewards: Sequence[Reward], extra: dict) -> None:
    """The saved statistics into the normalizers; one the checkpoint lacks starts afresh."""
    saved = extra.get("reward_normalizers", {})
    for reward in rewards:
        if reward.normalizer is not None and reward.name in saved:
            reward.normalizer.load_state_dict(saved[reward.name])
