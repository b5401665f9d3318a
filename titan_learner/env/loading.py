"""User objects of [env] and [[tool]]: `"file.py:Name"` (relative to the config file) or
`"package.module:Name"`, loaded as reward functions are (titan_learner.rewards.loading)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from titan_learner.rewards.loading import load_module_file

FILE_MODULE_PREFIX = "titan_learner_env_"
"""Environment and tool files are loaded as modules named this plus a hash of their path."""


class EnvLoadError(ValueError):
    """An environment, tool or parser that cannot be loaded: what was asked for, what is wrong."""


def load_object(spec: str, base_dir: Path) -> Any:
    """The object `spec` names; EnvLoadError says why not."""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise EnvLoadError(
            f"{spec!r} names nothing; allowed: 'file.py:Name' or 'package.module:Name'"
        )
    if module_part.endswith(".py"):
        path = Path(module_part) if Path(module_part).is_absolute() else base_dir / module_part
        if not path.is_file():
            raise EnvLoadError(f"{spec!r}: file {path} not found")
        try:
            module = load_module_file(
                f"{FILE_MODULE_PREFIX}{abs(hash(str(path.resolve())))}", str(path)
            )
        except Exception as err:
            raise EnvLoadError(
                f"{spec!r}: running {path} failed: {type(err).__name__}: {err}"
            ) from None
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as err:
            raise EnvLoadError(
                f"{spec!r}: importing {module_part} failed: {type(err).__name__}: {err}"
            ) from None
    found = getattr(module, name, None)
    if found is None:
        raise EnvLoadError(f"{spec!r}: {module_part} has no attribute {name!r}")
    return found
