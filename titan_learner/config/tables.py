"""Turn parsed TOML tables into typed dataclasses, or fail with one clear message.

Every error names the file, the section and key, what was found, and what is allowed, so that
`python -m titan_learner check` can print it on one line and exit 2. The rules come from the
dataclasses themselves: type hints (int, float, bool, str, Literal, optional, tuple, dict, nested
dataclass) and `field(metadata={"min": ..., "max": ...})` for ranges.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from titan_learner.config.errors import (
    ConfigError,
    describe_location,
    describe_table,
    did_you_mean,
)


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(set(args)) == 1:
            plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
            return f"an array of {len(args)} {plural.get(args[0], type_name(args[0]))}"
        return "an array of " + ", ".join(type_name(a) for a in args)
    if origin is dict:
        return "a table"
    if origin is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return "an array of tables"
        return f"an array of {type_name(item).removeprefix('a ').removeprefix('an ')}s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _convert(value: Any, tp: Any, path: tuple[str, ...], source: str) -> Any:
    where = describe_location(path)

    def fail(expected: str) -> typing.NoReturn:
        raise ConfigError(f"expected {expected}, got {value!r}", source=source, where=where)

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        present = [arg for arg in args if arg is not type(None)]
        if len(present) == 1:  # optional: the one type's own error says what is wrong
            return _convert(value, present[0], path, source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path, source)
            except ConfigError as err:
                errors.append(err)
        fail(type_name(tp))
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or type(value) is not type(allowed[0]):
            hint = did_you_mean(str(value), [str(a) for a in allowed])
            raise ConfigError(
                f"{value!r} is not allowed; allowed: {', '.join(repr(a) for a in allowed)}{hint}",
                source=source,
                where=where,
            )
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            fail(type_name(tp))
        return tuple(_convert(v, a, path, source) for v, a in zip(value, args, strict=False))
    if origin is dict:
        if not isinstance(value, dict):
            fail("a table")
        return dict(value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            fail(type_name(tp))
        return [
            _convert(v, item, (*path[:-1], f"{path[-1]}[{i}]"), source) for i, v in enumerate(value)
        ]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            fail(f"a [{'.'.join(path)}] table")
        return build_dataclass(tp, value, path=path, source=source)
    if tp is bool:
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail("a string")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")


def _check_range(value: Any, meta: typing.Mapping[str, Any], where: str, source: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):  # TOML has nan and inf
        raise ConfigError(
            f"{value!r} is not a finite number; allowed: a finite number",
            source=source,
            where=where,
        )
    low, high = meta.get("min"), meta.get("max")
    if low is not None and value < low:
        allowed = f">= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(
            f"{value!r} is out of range; allowed: {allowed}", source=source, where=where
        )
    if high is not None and value > high:
        allowed = (f">= {low} and " if low is not None else "") + f"<= {high}"
        raise ConfigError(
            f"{value!r} is out of range; allowed: {allowed}", source=source, where=where
        )
    for excluded in meta.get("not", ()):
        if value == excluded:
            allowed = meta.get("allowed", f"anything but {excluded!r}")
            raise ConfigError(
                f"{value!r} is not allowed; allowed: {allowed}", source=source, where=where
            )


def toml_key(f: dataclasses.Field) -> str:
    """The key a user writes for a field: its name, or `metadata["key"]` where the name cannot
    be a Python identifier ([env] class is the field `class_`)."""
    return f.metadata.get("key", f.name)


def build_dataclass(cls: type, data: dict[str, Any], *, path: tuple[str, ...], source: str) -> Any:
    """Build `cls` from a TOML table, rejecting unknown keys and bad values."""
    hints = typing.get_type_hints(cls)
    fields = {toml_key(f): f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown key '{key}'{did_you_mean(key, fields)}; allowed keys: {known}",
                source=source,
                where=describe_table(path),
            )
    kwargs = {
        fields[key].name: check_value(
            value, hints[fields[key].name], fields[key].metadata, (*path, key), source
        )
        for key, value in data.items()
    }
    return cls(**kwargs)


def check_value(
    value: Any, tp: Any, limits: typing.Mapping[str, Any], path: tuple[str, ...], source: str
) -> Any:
    """One value checked as a dataclass field is (type hint, then `min`/`max`/`not` limits),
    converted; also for keys that are no field ([loss]: `titan_learner.config.loss_values`)."""
    converted = _convert(value, tp, path, source)
    _check_range(converted, limits, describe_location(path), source)
    return converted


def as_plain_dict(obj: Any) -> Any:
    """A dataclass tree as nested plain dicts (tuples as lists), for printing and saving."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_plain_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_plain_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_plain_dict(v) for k, v in obj.items()}
    return obj
