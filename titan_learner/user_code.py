"""A user's object named in the config: `"file.py:Name"` (relative to the config file's
directory) or `"package.module:Name"` (imported from the Python path). Reward functions,
environments, tools and tool-call parsers are all named this way; each caller brings the error
class its users read."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_user_object(
    spec: str, base_dir: Path, *, error: type[Exception], module_prefix: str, malformed: str
) -> Any:
    """The object `spec` names, or `error` saying why not (`malformed`: the message for a spec
    that is not `module:Name`, with what is allowed)."""
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise error(malformed)
    if module_part.endswith(".py"):
        path = Path(module_part) if Path(module_part).is_absolute() else base_dir / module_part
        if not path.is_file():
            raise error(f"{spec!r}: file {path} not found")
        try:
            module = load_module_file(f"{module_prefix}{abs(hash(str(path.resolve())))}", str(path))
        except Exception as err:
            raise error(f"{spec!r}: running {path} failed: {type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as err:
            raise error(
                f"{spec!r}: importing {module_part} failed: {type(err).__name__}: {err}"
            ) from None
    found = getattr(module, name, None)
    if found is None:
        raise error(f"{spec!r}: {module_part} has no attribute {name!r}")
    return found


def load_module_file(module_name: str, path: str) -> ModuleType:
    """The module of a user's file, under the name its functions pickle by (a reward worker
    loads it under the same name before it unpickles one)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module
