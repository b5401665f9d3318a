"""The episode loop, token-in/token-out: each episode is kept as token ids from its first prompt
to its end. The model's turns are the generator's ids and behaviour log-probs as returned; the
environment's turns (tool results, replies) are chat-template deltas appended after them
(`render.ChatRenderer.delta`); nothing already in the episode is encoded again. The trained
mask covers exactly the sampled ids; every other position carries no log-prob (NaN).

The episodes of a step advance together: one `generate` call per turn holds every episode that
is still running, and an episode that is done leaves the batch. The first turn samples the G
episodes of each prompt as one group (`generate(prompts, G, ...)`), the very call of the
single-turn job: a one-turn episode is a single-turn rollout, id for id.

An episode ends when the environment says done (`finished`), or is truncated: max_turns model
turns, max_total_tokens reached (a turn is cut to what is left; an environment turn that does
not fit is not appended), or an environment step that overran step_timeout_s. A turn that
reaches max_new_tokens without an EOS is a turn like any other (its text goes to the tools or
the environment); the template's whole closing of it, which the model did not sample, is
context before the next turn.

The tool calls of a turn's episodes run at once, on up to `tool_workers` threads (tools wait
on the network, a sandbox, a search index); answers keep their calls' order. Environment steps
run one after another (a user environment need not be thread-safe).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from titan_learner.env.environment import (
    EnvError,
    Environment,
    Messages,
    checked_messages,
    checked_step,
)
from titan_learner.env.render import ChatRenderer
from titan_learner.env.timeout import CallTimeout, call_with_timeout
from titan_learner.env.tool_calls import Parser, ToolCall
from titan_learner.env.tools import Tool, ToolAnswer, answer
from titan_learner.rollout.base import Generator, Rollout


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_total_tokens: int
    max_new_tokens: int
    """Per model turn."""
    step_timeout_s: float
    tool_workers: int = 1
    """Threads answering a turn's tool calls at once (1: one call after another)."""


@dataclass
class EpisodeSetup:
    """What every episode of a run shares."""

    renderer: ChatRenderer
    make_env: Callable[[], Environment]
    env_name: str
    """How errors name the environment ("[env] class 'envs.py:Lookup'", or the built-in's)."""
    tools: dict[str, Tool]
    parse: Parser
    limits: Limits
    eos_ids: Sequence[int]
    pad_id: int
    decode: Callable[[list[int]], str]
    """Ids to text with special tokens kept (tool-call markers can be special tokens)."""


@dataclass
class Episode:
    prompt: list[int]
    env: Environment
    origin: str
    messages: Messages
    ids: list[int] = field(default_factory=list)
    """Everything after the first prompt: sampled and environment ids, in order."""
    sampled: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None
    """The sum of the rewards the environment returned; None when it returned none."""
    last_turn: str = ""
    """The text of the model's last turn, special tokens kept (what tool calls are read from)."""
    last_ids: list[int] = field(default_factory=list)
    """The ids of the model's last turn (what [[reward]] functions score, decoded)."""
    done: bool = False
    finished: bool = False
    """Ended by the environment (done), not by a limit."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def append(self, ids: list[int], log_probs: list[float] | None) -> None:
        self.ids += ids
        self.sampled += [log_probs is not None] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [math.nan] * len(ids)

    def end(self, finished: bool) -> None:
        self.done, self.finished = True, finished


@dataclass
class Episodes:
    """A step's episodes, G per prompt in the rollout's row order, and their rollout."""

    episodes: list[Episode]
    rollout: Rollout

    @property
    def truncated(self) -> int:
        return sum(not e.finished for e in self.episodes)


def start(setup: EpisodeSetup, row: dict, origin: str) -> Episode:
    """A new episode of `row`: its environment built and reset, its first prompt rendered."""
    try:
        env = setup.make_env()
        messages = checked_messages(env.reset(row), f"{setup.env_name} reset on {origin}")
    except EnvError:
        raise
    except Exception as err:
        raise EnvError(
            f"{setup.env_name} raised on {origin} at reset: {type(err).__name__}: {err}"
        ) from None
    return Episode(setup.renderer.first(messages), env, origin, list(messages))


def run_episodes(
    generator: Generator,
    rows: Sequence[tuple[dict, str]],
    group_size: int,
    setup: EpisodeSetup,
    temperature: float,
    rng: torch.Generator,
) -> Episodes:
    """`group_size` episodes of each (row, origin), run to their ends."""
    episodes = []
    for row, origin in rows:
        group = [start(setup, row, origin) for _ in range(group_size)]
        if any(e.prompt != group[0].prompt for e in group):
            raise EnvError(
                f"{setup.env_name} reset gave the {group_size} episodes of {origin} different "
                "first messages; allowed: one first prompt per row (its episodes are one group)"
            )
        episodes += group
    limits = setup.limits
    for e in episodes:
        if e.length >= limits.max_total_tokens:
            e.end(finished=False)
    first, pad_id, version = True, setup.pad_id, generator.weights_version
    while active := [e for e in episodes if not e.done]:
        budget = min(limits.max_new_tokens, max(limits.max_total_tokens - e.length for e in active))
        if first and len(active) == len(episodes):
            prompts = [e.prompt for e in active[::group_size]]
            sampled = generator.generate(prompts, group_size, budget, temperature, rng)
        else:
            contexts = [e.prompt + e.ids for e in active]
            sampled = generator.generate(contexts, 1, budget, temperature, rng)
        first, version = False, sampled.weights_version
        rows_ids = sampled.completion_ids
        rows_lps = sampled.completion_log_probs.tolist()
        turns = [
            open_turn(setup, e, ids, lps[: len(ids)])
            for e, ids, lps in zip(active, rows_ids, rows_lps, strict=True)
        ]
        answers = answer_calls(setup, [turn.calls if turn else [] for turn in turns])
        for e, turn, answered in zip(active, turns, answers, strict=True):
            if turn is not None:
                close_turn(setup, e, turn, answered)
    return Episodes(episodes, to_rollout(episodes, group_size, pad_id, version))


@dataclass(frozen=True)
class OpenTurn:
    """A sampled turn appended to its episode, waiting for the tools or the environment."""

    calls: list[ToolCall]
    """Its tool calls; none: the environment answers it."""
    eos: int | None
    """The EOS id that closed it, or None (cut at max_new_tokens)."""


def open_turn(
    setup: EpisodeSetup, e: Episode, ids: list[int], log_probs: list[float]
) -> OpenTurn | None:
    """Append one sampled turn to `e`; None when it ended the episode (cut at the budget)."""
    room = setup.limits.max_total_tokens - e.length
    e.append(ids[:room], log_probs[:room])
    e.last_ids = ids[:room]
    e.turns += 1
    eos = ids[-1] if ids and ids[-1] in setup.eos_ids else None
    if len(ids) > room:  # cut at the budget
        e.last_turn = setup.decode(ids[:room])
        e.end(finished=False)
        return None
    e.last_turn = setup.decode(ids[:-1] if eos is not None else ids)
    e.messages.append({"role": "assistant", "content": e.last_turn})
    return OpenTurn(setup.parse(e.last_turn) if setup.tools else [], eos)


def answer_calls(
    setup: EpisodeSetup, calls_per_turn: list[list[ToolCall]]
) -> list[list[ToolAnswer]]:
    """The answers to every tool call of a turn's episodes, each turn's in its calls' order;
    the calls run at once on up to `tool_workers` threads."""
    flat = [call for calls in calls_per_turn for call in calls]
    timeout_s, workers = setup.limits.step_timeout_s, setup.limits.tool_workers

    def one(call: ToolCall) -> ToolAnswer:
        return answer(setup.tools, call, timeout_s)

    if workers == 1 or len(flat) <= 1:
        answered = [one(call) for call in flat]
    else:
        with ThreadPoolExecutor(
            min(workers, len(flat)), thread_name_prefix="titan-learner-tool"
        ) as pool:
            answered = list(pool.map(one, flat))
    done = iter(answered)
    return [[next(done) for _ in calls] for calls in calls_per_turn]


def close_turn(setup: EpisodeSetup, e: Episode, turn: OpenTurn, answers: list[ToolAnswer]) -> None:
    """The tools' answers to `turn` (or the environment's), appended, or the episode's end."""
    limits = setup.limits
    if turn.calls:
        new, reward, done = [a.message for a in answers], None, False
        e.tool_calls += len(turn.calls)
        e.tool_errors += sum(a.error for a in answers)
    else:
        stepped = env_step(setup, e)
        if stepped is None:
            e.end(finished=False)
            return
        new, reward, done = stepped
    if reward is not None:
        e.env_reward = (e.env_reward or 0.0) + reward
    if done:
        e.end(finished=True)
        return
    if e.turns >= limits.max_turns:
        e.end(finished=False)
        return
    delta = setup.renderer.delta(new, turn.eos)
    if e.length + len(delta) >= limits.max_total_tokens:  # no room to sample after it
        e.end(finished=False)
        return
    e.append(delta, None)
    e.messages += new


def env_step(setup: EpisodeSetup, e: Episode) -> tuple[Messages, float | None, bool] | None:
    """The environment's answer to the last turn; None when it overran step_timeout_s."""
    what = f"{setup.env_name} step on {e.origin}"
    try:
        value = call_with_timeout(
            e.env.step, (list(e.messages), e.last_turn), {}, setup.limits.step_timeout_s
        )
    except CallTimeout:
        return None
    except Exception as err:
        raise EnvError(
            f"{setup.env_name} raised on {e.origin} at turn {e.turns}: {type(err).__name__}: {err}"
        ) from None
    return checked_step(value, what)


def to_rollout(episodes: list[Episode], group_size: int, pad_id: int, version: int) -> Rollout:
    """The episodes as a Rollout: the first prompt of each group, then every id after it, the
    sampled ones marked by `completion_mask` and alone carrying log-probs."""
    n, width = len(episodes), max((len(e.ids) for e in episodes), default=0)
    tokens = torch.full((n, width), pad_id, dtype=torch.int64)
    log_probs = torch.full((n, width), torch.nan)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for row, e in enumerate(episodes):
        tokens[row, : len(e.ids)] = torch.as_tensor(e.ids, dtype=torch.int64)
        log_probs[row, : len(e.ids)] = torch.as_tensor(e.log_probs, dtype=torch.float32)
        mask[row, : len(e.ids)] = torch.as_tensor(e.sampled, dtype=torch.bool)
    return Rollout(
        prompts=[e.prompt for e in episodes[::group_size]],
        group_size=group_size,
        completion_tokens=tokens,
        completion_log_probs=log_probs,
        completion_lengths=torch.tensor([len(e.ids) for e in episodes], dtype=torch.int64),
        finished=torch.tensor([e.finished for e in episodes], dtype=torch.bool),
        pad_id=pad_id,
        weights_version=version,
        completion_mask=mask,
    )
