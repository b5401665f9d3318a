"""The environment of an episode: `reset(row) -> messages` (the first prompt) and
`step(messages, completion) -> (new messages, reward or None, done)` after each model turn
that the tools did not answer. A user class is built once per episode, with no arguments, so
it may keep the episode's state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from titan_learner.env.loading import EnvLoadError, load_object

Messages = list[dict[str, Any]]


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> Messages: ...

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float | None, bool]: ...


class EnvError(RuntimeError):
    """A user environment that raised or returned something else than the protocol's; one line
    naming the environment and the row."""


class Answer:
    """The built-in environment: the row's prompt, done at the first turn the tools do not
    answer (with no tools, the single-turn job). Rewards come from [[reward]] alone."""

    def __init__(self, messages_of: Callable[[dict], Messages]) -> None:
        self.messages_of = messages_of

    def reset(self, row: dict) -> Messages:
        return self.messages_of(row)

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float | None, bool]:
        return [], None, True


def environment_factory(spec: str, base_dir: Path) -> Callable[[], Environment]:
    """The class [env] class names, checked to have reset and step."""
    cls = load_object(spec, base_dir)
    if not isinstance(cls, type):
        raise EnvLoadError(f"{spec!r} is a {type(cls).__name__}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise EnvLoadError(
            f"{spec!r}: {cls.__name__} has no {' or '.join(missing)}; an environment has "
            "reset(row) -> messages and step(messages, completion) -> (messages, reward, done)"
        )
    return cls


def checked_messages(value: Any, what: str) -> Messages:
    """`value` as a list of {"role": str, "content": ...} messages, or EnvError naming `what`."""
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    ):
        raise EnvError(
            f'{what} returned {value!r:.200}; allowed: a list of {{"role": ..., "content": ...}}'
        )
    return value


def checked_step(value: Any, what: str) -> tuple[Messages, float | None, bool]:
    """A step's (messages, reward or None, done), or EnvError naming `what`."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise EnvError(f"{what} returned {value!r:.200}; allowed: (messages, reward or None, done)")
    messages, reward, done = value
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise EnvError(f"{what} returned the reward {reward!r}; allowed: a number or None")
    return checked_messages(messages, what), None if reward is None else float(reward), bool(done)
