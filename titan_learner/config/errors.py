"""ConfigError, the one error type of every configuration problem, and its wording helpers.

Every message names the file, the section and key, what was found and what is allowed, so that
the command line prints it as one `error:` line and exits 2.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path

_ARRAY_ITEM = re.compile(r"(\w+)\[(\d+)\]")


class ConfigError(ValueError):
    """A configuration problem, reported as `file: [section] key: message`."""

    def __init__(self, message: str, *, source: str | Path | None = None, where: str = ""):
        self.source = str(source) if source is not None else "<config>"
        self.where = where
        self.detail = message
        prefix = f"{self.source}: " + (f"{where}: " if where else "")
        super().__init__(prefix + message)

    def __reduce__(self):
        """Pickled whole (an error one rank sends to the others keeps its file and key)."""
        return (_rebuild, (self.detail, self.source, self.where))


def _rebuild(message: str, source: str, where: str) -> ConfigError:
    return ConfigError(message, source=source, where=where)


def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix when a close match exists, else ''."""
    by_lower = {str(c).lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean '{by_lower[close[0]]}'?)" if close else ""


def describe_location(path: tuple[str, ...]) -> str:
    """`[section] key` for a key, `[section]` for a table, `[[reward]] #2 key` in an array."""
    if not path:
        return ""
    array = _ARRAY_ITEM.fullmatch(path[0])
    if array:
        table = f"[[{array.group(1)}]] #{int(array.group(2)) + 1}"
        return " ".join([table, *path[1:]]) if len(path) <= 2 else f"{table} {'.'.join(path[1:])}"
    if len(path) == 1:
        return f"[{path[0]}]"
    return f"[{'.'.join(path[:-1])}] {path[-1]}"


def describe_table(path: tuple[str, ...]) -> str:
    """`[model.overrides]` for a table, `[[reward]] #2` for an entry of an array of tables."""
    if not path:
        return ""
    array = _ARRAY_ITEM.fullmatch(path[-1])
    if array and len(path) == 1:
        return f"[[{array.group(1)}]] #{int(array.group(2)) + 1}"
    return f"[{'.'.join(path)}]"
