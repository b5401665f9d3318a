"""User reward functions: `"file.py:name"` (relative to the config file) or `"package.module:name"`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from titan_learner.rewards.builtins import BUILTINS
from titan_learner.user_code import load_user_object

FILE_MODULE_PREFIX = "titan_learner_reward_"
"""Reward files are loaded as modules named this plus a hash of their path."""


class RewardLoadError(ValueError):
    """A reward function that cannot be loaded: what was asked for and what is wrong."""


def load_function(spec: str, base_dir: Path) -> Callable:
    """The callable `spec` names; RewardLoadError says why not.

    `spec` is "path/to/file.py:name" (a relative path is taken from `base_dir`, the config
    file's directory) or "package.module:name" (imported from the Python path).
    """
    function = load_user_object(
        spec,
        base_dir,
        error=RewardLoadError,
        module_prefix=FILE_MODULE_PREFIX,
        malformed=f"{spec!r} names no function; allowed: {', '.join(BUILTINS)}, "
        "'file.py:function' or 'package.module:function'",
    )
    if not callable(function):
        raise RewardLoadError(
            f"{spec!r}: {spec.rpartition(':')[2]} is a {type(function).__name__}, not a function"
        )
    _check_signature(function, spec)
    return function


def _check_signature(function: Callable, spec: str) -> None:
    """score(prompt, completion, row) must be callable with three positional arguments."""
    try:
        inspect.signature(function).bind("prompt", "completion", {})
    except TypeError:
        raise RewardLoadError(
            f"{spec!r}: {getattr(function, '__name__', function)}{inspect.signature(function)} "
            "cannot be called as score(prompt: str, completion: str, row: dict) -> float"
        ) from None
    except ValueError:  # no signature (a builtin): trust it
        return
