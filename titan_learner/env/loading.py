"""User objects of [env] and [[tool]]: `"file.py:Name"` (relative to the config file) or
`"package.module:Name"`, loaded as reward functions are (titan_learner.user_code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_learner.user_code import load_user_object

FILE_MODULE_PREFIX = "titan_learner_env_"
"""Environment and tool files are loaded as modules named this plus a hash of their path."""


class EnvLoadError(ValueError):
    """An environment, tool or parser that cannot be loaded: what was asked for, what is wrong."""


def load_object(spec: str, base_dir: Path) -> Any:
    """The object `spec` names; EnvLoadError says why not."""
    return load_user_object(
        spec,
        base_dir,
        error=EnvLoadError,
        module_prefix=FILE_MODULE_PREFIX,
        malformed=f"{spec!r} names nothing; allowed: 'file.py:Name' or 'package.module:Name'",
    )
