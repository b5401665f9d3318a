"""Multi-turn episodes in the job ([env], [[tool]]): what they are built from, how a step or an
evaluation samples them, what their rewards and metrics add.

The rewards of an episode: the [[reward]] functions score the text of the model's last turn
(its answer, as a single-turn completion is scored), and the environment's rewards (the sum
of what its step returned) are added as `reward/env`. A one-turn episode of the built-in
environment is a single-turn completion, scored the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from titan_learner.config.derived import episode_tokens
from titan_learner.config.env_values import TOOL_PARSERS, multi_turn
from titan_learner.config.errors import ConfigError, describe_location
from titan_learner.config.schema import Config
from titan_learner.data.loader import Prompt
from titan_learner.data.tokenizer import PromptTokenizer
from titan_learner.env.environment import Answer, Environment, environment_factory
from titan_learner.env.episode import Episodes, EpisodeSetup, Limits, run_episodes
from titan_learner.env.loading import EnvLoadError
from titan_learner.env.render import ChatRenderer
from titan_learner.env.tool_calls import Parser, tool_parser
from titan_learner.env.tools import Tool, load_tools
from titan_learner.job.collectives import gather_over
from titan_learner.rewards.runner import Scores

ENV_REWARD = "env"
"""The environment's rewards in the metrics: reward/env_mean."""


@dataclass(frozen=True)
class EnvParts:
    make_env: Callable[[], Environment] | None
    """The [env] class; None: the built-in environment."""
    tools: dict[str, Tool]
    parser: Parser | None
    """A user's [env] tool_parser; None: a built-in one, chosen by the chat template."""


def load_env_parts(config: Config) -> EnvParts:
    """The [env] class, the [[tool]] functions and a user's tool parser, loaded; one-line
    ConfigError otherwise."""
    base = Path(config.source).parent
    make_env = None
    if config.env.class_:
        try:
            make_env = environment_factory(config.env.class_, base)
        except EnvLoadError as err:
            raise ConfigError(str(err), source=config.source, where="[env] class") from None
    tools: dict[str, Tool] = {}
    for index, section in enumerate(config.tool):
        try:
            tools |= load_tools([section.function], base)
            if len(tools) != index + 1:
                raise EnvLoadError(
                    f"{section.function!r}: another [[tool]] has its name; allowed: one tool a name"
                )
        except EnvLoadError as err:
            where = describe_location((f"tool[{index}]", "function"))
            raise ConfigError(str(err), source=config.source, where=where) from None
    parser = None
    if config.env.tool_parser not in TOOL_PARSERS:
        try:
            parser = tool_parser(config.env.tool_parser, None, base)
        except EnvLoadError as err:
            raise ConfigError(str(err), source=config.source, where="[env] tool_parser") from None
    return EnvParts(make_env, tools, parser)


def build_episode_setup(config: Config, tokenizer: PromptTokenizer) -> EpisodeSetup | None:
    """What every episode of the run shares; None for the single-turn job."""
    if not multi_turn(config):
        return None
    if tokenizer.template is None:
        raise ConfigError(
            "multi-turn episodes render their turns with the chat template; allowed: auto or a "
            ".jinja file",
            source=config.source,
            where="[tokenizer] chat_template",
        )
    parts = load_env_parts(config)
    parse = parts.parser or tool_parser(
        config.env.tool_parser, tokenizer.template, Path(config.source).parent
    )
    schemas = [tool.schema for tool in parts.tools.values()] or None
    return EpisodeSetup(
        renderer=ChatRenderer(tokenizer.tokenizer, tokenizer.template, schemas),
        make_env=parts.make_env or (lambda: Answer(lambda row: tokenizer.messages(row, ""))),
        env_name=f"[env] class {config.env.class_!r}" if config.env.class_ else "[[tool]] episode",
        tools=parts.tools,
        parse=parse,
        limits=Limits(
            max_turns=config.env.max_turns,
            max_total_tokens=episode_tokens(config),
            max_new_tokens=config.rollout.max_new_tokens,
            step_timeout_s=config.env.step_timeout_s,
            tool_workers=config.env.tool_workers,
        ),
        eos_ids=tokenizer.eos_ids,
        pad_id=tokenizer.pad_id,
        decode=lambda ids: tokenizer.tokenizer.decode(ids, skip_special_tokens=False),
    )


def sample_episodes(
    setup: EpisodeSetup,
    generator,
    prompts: Sequence[Prompt],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    rng: torch.Generator,
) -> Episodes:
    """`group_size` episodes of each prompt's row, advancing together."""
    if max_new_tokens != setup.limits.max_new_tokens:  # evaluation's own
        setup = replace(setup, limits=replace(setup.limits, max_new_tokens=max_new_tokens))
    rows = [(p.row, p.origin) for p in prompts]
    return run_episodes(generator, rows, group_size, setup, temperature, rng)


def answer_texts(episodes: Episodes, decode: Callable[[list[int]], str]) -> list[str]:
    """What [[reward]] functions score: each episode's last model turn, decoded as a
    single-turn completion is."""
    return [decode(e.last_ids) for e in episodes.episodes]


def add_env_rewards(scores: Scores, episodes: Episodes) -> None:
    """The environment's rewards into the totals, as `reward/env` (0 where it gave none)."""
    values = torch.tensor([e.env_reward or 0.0 for e in episodes.episodes], dtype=torch.float32)
    scores.per_reward[ENV_REWARD] = values
    scores.total = scores.total + values


def episode_metrics(episodes: Episodes, group, device: torch.device) -> dict[str, float]:
    """turns_mean, tool_calls_mean, tool_errors, episode_tokens_mean, episodes_truncated over
    every data-parallel rank's episodes (a collective)."""
    columns = torch.tensor(
        [
            [e.turns, e.tool_calls, e.tool_errors, len(e.ids), not e.finished]
            for e in episodes.episodes
        ],
        dtype=torch.float32,
    ).reshape(-1, 5)
    every = gather_over(columns, group, device)
    count = max(every.shape[0], 1)
    turns, calls, errors, tokens, truncated = every.sum(0).tolist()
    return {
        "turns_mean": turns / count,
        "tool_calls_mean": calls / count,
        "tool_errors": errors,
        "episode_tokens_mean": tokens / count,
        "episodes_truncated": truncated,
    }


def episode_sample(episodes: Episodes | None, index: int, tokenizer: PromptTokenizer) -> dict:
    """samples.jsonl's view of episode `index`: every turn after the prompt as text, its turns
    and tool calls (nothing for a single-turn rollout)."""
    if episodes is None:
        return {}
    e = episodes.episodes[index]
    return {
        "episode": tokenizer.tokenizer.decode(e.ids, skip_special_tokens=False),
        "turns": e.turns,
        "tool_calls": e.tool_calls,
    }
