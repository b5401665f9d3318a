"""The checks of [env] and [[tool]] that the file alone decides: the shape of every
"file.py:Name" / "package.module:Name" reference, the tool parser, and what multi-turn episodes
run with. Loading the classes and functions they name is `titan_learner.job.validate`'s."""

from __future__ import annotations

from titan_learner.config.errors import ConfigError, describe_location
from titan_learner.config.schema import Config

TOOL_PARSERS = ("auto", "hermes", "llama3")
"""The built-in tool-call formats of [env] tool_parser (a user function is the other choice)."""


def multi_turn(config: Config) -> bool:
    """Episodes with an environment: [env] class or at least one [[tool]]."""
    return bool(config.env.class_) or bool(config.tool)


def is_reference(spec: str) -> bool:
    """ "file.py:Name" or "package.module:Name": a module part and a name around one colon."""
    module, sep, name = spec.rpartition(":")
    return bool(sep and module.strip() and name.strip().isidentifier())


def check_env(config: Config) -> None:
    """[env] and [[tool]] references are well formed."""
    env, source = config.env, config.source
    if env.class_ is not None and not is_reference(env.class_):
        raise ConfigError(
            f"{env.class_!r} names no class; allowed: 'file.py:Name' or 'package.module:Name'",
            source=source,
            where="[env] class",
        )
    if env.tool_parser not in TOOL_PARSERS and not is_reference(env.tool_parser):
        raise ConfigError(
            f"{env.tool_parser!r} is no tool parser; allowed: {', '.join(TOOL_PARSERS)}, "
            "'file.py:function' or 'package.module:function'",
            source=source,
            where="[env] tool_parser",
        )
    for i, tool in enumerate(config.tool):
        if not is_reference(tool.function):
            raise ConfigError(
                f"{tool.function!r} names no function; allowed: 'file.py:function' or "
                "'package.module:function'",
                source=source,
                where=describe_location((f"tool[{i}]", "function")),
            )
