"""User reward functions: `"file.py:name"` (relative to the config file) or `"package.module:name"`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from titan_learner.rewards.builtins import BUILTINS

FILE_MODULE_PREFIX = "titan_learner_reward_"
"""Reward files are loaded as modules named this plus a hash of their path."""


class RewardLoadError(ValueError):
    """A reward function that cannot be loaded: what was asked for and what is wrong."""


def load_function(spec: str, base_dir: Path) -> Callable:
    """The callable `spec` names; RewardLoadError says why not.

    `spec` is "path/to/file.py:name" (a relative path is taken from `base_dir`, the config
    file's directory) or "package.module:name" (imported from the Python path).
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise RewardLoadError(
            f"{spec!r} names no function; allowed: {', '.join(BUILTINS)}, "
            "'file.py:function' or 'package.module:function'"
        )
    if module_part.endswith(".py"):
        module = _load_file(
            Path(module_part) if Path(module_part).is_absolute() else base_dir / module_part, spec
        )
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as err:
            raise RewardLoadError(
                f"{spec!r}: importing {module_part} failed: {type(err).__name__}: {err}"
            ) from None
    function = getattr(module, name, None)
    if function is None:
        raise RewardLoadError(f"{spec!r}: {module_part} has no attribute {name!r}")
    if not callable(function):
        raise RewardLoadError(f"{spec!r}: {name} is a {type(function).__name__}, not a function")
    _check_signature(function, spec)
    return function


def _load_file(path: Path, spec: str):
    if not path.is_file():
        raise RewardLoadError(f"{spec!r}: file {path} not found")
    module_name = f"{FILE_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
    try:
        return load_module_file(module_name, str(path))
    except Exception as err:
        raise RewardLoadError(
            f"{spec!r}: running {path} failed: {type(err).__name__}: {err}"
        ) from None


def load_module_file(module_name: str, path: str):
    """The module of a reward file, under the name its functions pickle by (a reward worker
    loads it under the same name before it unpickles one)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


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
