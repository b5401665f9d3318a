"""Reading a run's TOML file (with `--set` overrides) into a Config, and writing one back.

`load_config` is the one entry point: read, override, build the typed sections, validate what
needs no world size (`validate.validate_fields`). `config_to_toml` is its inverse: a checkpoint
root holds the resolved config of the run that wrote it.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError, describe_location, did_you_mean
from titan_learner.config.schema import ARRAY_SECTIONS, SECTIONS, Config
from titan_learner.config.tables import build_dataclass, toml_key
from titan_learner.config.validate import validate_fields


def _parse_override(item: str) -> tuple[list[str], Any]:
    malformed = ConfigError(
        f"'{item}': expected SECTION.KEY=VALUE (a TOML value), e.g. parallelism.tp=2",
        source="--set",
    )
    if "=" not in item:
        raise malformed
    dotted, raw = item.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise malformed
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: name=qwen3
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str) -> None:
    """Apply `section.key=value` strings (values in TOML syntax) onto the parsed tables."""
    for item in overrides:
        keys, value = _parse_override(item)
        table = data
        for key in keys[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(f"'{item}': '{key}' is not a table", source="--set")
        table[keys[-1]] = value


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> Config:
    """Build parsed tables into a checked Config (world size, machine and job: `validate`)."""
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}]{did_you_mean(section, SECTIONS)}; "
                f"allowed sections: {', '.join(SECTIONS)}",
                source=source,
            )
        if section in ARRAY_SECTIONS:
            if not isinstance(data[section], list):
                raise ConfigError(
                    f"[{section}] must be an array of tables, written [[{section}]]", source=source
                )
        elif not isinstance(data[section], dict):
            raise ConfigError(f"[{section}] must be a table", source=source)
    loss_table = dict(data.get("loss", {}))
    loss_name = loss_table.pop("name", "grpo")
    tables = {k: v for k, v in data.items() if k != "loss"}
    tables["loss"] = {"name": loss_name, "kwargs": loss_table}
    config = build_dataclass(Config, tables, path=(), source=source)
    config.source = source
    if config.model.hf_checkpoint == "":  # lets `--set model.hf_checkpoint=""` mean "none"
        config.model.hf_checkpoint = None
    validate_fields(config)
    return config


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a TOML file into a typed Config."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", source=source) from None
    except OSError as err:
        raise ConfigError(f"cannot read file: {err.strerror}", source=source) from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"not UTF-8 text (byte {err.start}); allowed: a TOML file", source=source
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}", source=source) from None
    apply_overrides(data, overrides or [], source)
    return config_from_dict(data, source)


# -- the resolved config as TOML ------------------------------------------------------------------

RESOLVED_CONFIG = "config.toml"
"""The file a checkpoint root holds: the config that trained it, so an export needs no other."""

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def config_to_toml(config: Config) -> str:
    """The config as TOML that `load_config` reads back to an equal Config (`source` aside).

    One table per section in schema order, then its sub-tables (`[[reward]]` once per entry);
    `[loss]` holds `name` and the
    loss keyword arguments as plain keys, as a user writes them. An empty sub-table whose default
    is empty (`[reward.judge]` under a function reward) is left out: it reads back the same. TOML
    has no null: a None is left out, which reads back as the field's default, so a None whose
    default is not None (set from Python) raises ValueError instead of changing meaning.
    """
    tables = []
    for name in SECTIONS:
        section = getattr(config, name)
        if name == "loss":
            table = {"name": section.name, **_plain(section.kwargs, ("loss",))}
        elif isinstance(section, list):  # an array of tables: [[reward]]
            for i, item in enumerate(section):
                block = _toml_table(name, _plain(item, (f"{name}[{i}]",)))
                tables.append("[" + block.replace("]", "]]", 1))
            continue
        else:
            table = _plain(section, (name,))
        tables.append(_toml_table(name, table))
    return "\n".join(tables)


def resolved_config_text(config: Config) -> str:
    """The text of a run's `config.toml`: `config_to_toml(config)` under a line saying where
    it came from (written by `titan_learner.checkpoint.layout.save_resolved_config`)."""
    source = _toml_string(config.source)  # one line, whatever the path holds
    return f"# The resolved config of this run (from {source}); read by `export`.\n" + (
        config_to_toml(config) + "\n"
    )


_NO_DEFAULT = object()


def _plain(obj: Any, path: tuple[str, ...]) -> dict[str, Any]:
    """A section (dataclass) or table (dict) as a dict of TOML-representable values."""
    if dataclasses.is_dataclass(obj):
        items = [(toml_key(f), getattr(obj, f.name), _default(f)) for f in dataclasses.fields(obj)]
    else:
        items = [(key, value, _NO_DEFAULT) for key, value in obj.items()]
    out: dict[str, Any] = {}
    for key, value, default in items:
        where = (*path, key)
        if value is None:
            if default is None:  # left out, it reads back as the default: None
                continue
            meaning = "drop the key" if default is _NO_DEFAULT else f"mean {default!r}"
            raise ValueError(
                f"{describe_location(where)} = None has no TOML form (TOML has no null) and leaving "
                f"it out would {meaning}; set a value instead"
            )
        if value == {} and default == {}:  # an optional sub-table not given: [reward.judge]
            continue
        if dataclasses.is_dataclass(value) or isinstance(value, dict):
            out[key] = _plain(value, where)
        else:
            out[key] = _plain_value(value, where)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def _plain_value(value: Any, where: tuple[str, ...]) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain_value(v, where) for v in value]
    if isinstance(value, dict):
        return _plain(value, where)
    if value is None or not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{describe_location(where)}: {value!r} has no TOML form")
    return value


def _toml_table(name: str, table: dict[str, Any], prefix: str = "") -> str:
    header = f"[{prefix}{_toml_key(name)}]"
    scalars, subtables = [], []
    for key, value in table.items():
        if isinstance(value, dict):
            subtables.append(_toml_table(key, value, prefix=f"{prefix}{_toml_key(name)}."))
        else:
            scalars.append(f"{_toml_key(key)} = {_toml_value(value)}")
    return "\n".join([header, *scalars, *subtables])


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)  # ints; floats as 1e-05, 0.9, inf, -inf, nan: all TOML
