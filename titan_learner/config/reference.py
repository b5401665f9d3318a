"""Every key of the TOML file, described from the schema itself: type, default, allowed values
and meaning.

The schema's dataclasses are the one source: a field's type hint and `min`/`max` limits are what
`config.tables` enforces, its attribute docstring (the string right below it in schema.py) is
its meaning, and the [loss] keys come from `config.loss_values`, the table their values are
checked against. `docs/config.md` is this reference rendered (scripts/config_reference.py
writes it; a test fails when it is out of date) and `titan-learner check --explain KEY` prints
one entry, so the documentation cannot drift from what the code accepts.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.loss_values import LOSS_KEYS, PROJECT_DEFAULTS
from titan_learner.config.schema import SECTIONS, Config, LossSection
from titan_learner.config.tables import toml_key, type_name
from titan_learner.config.vllm_keys import PASS_THROUGH, VLLM_OWN_KEYS

_NO_DEFAULT = "(required)"


@dataclass(frozen=True)
class KeyDoc:
    """One key as a user writes it: `[section] key` (dotted for sub-tables)."""

    section: str
    key: str
    kind: str
    default: str
    limits: str
    meaning: str

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    def explain(self) -> str:
        """The entry as `check --explain` prints it."""
        lines = [f"[{self.section}] {self.key}", f"  type:    {self.kind}"]
        lines.append(f"  default: {self.default}")
        if self.limits:
            lines.append(f"  allowed: {self.limits}")
        if self.meaning:
            lines += ["", textwrap.indent(textwrap.fill(self.meaning, 92), "  ")]
        return "\n".join(lines)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written right below a dataclass's fields (PEP 257 attribute docstrings),
    read from the source: Python keeps no trace of them at run time."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field_node, next_node in itertools.pairwise(body):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(next_node, ast.Expr)
            and isinstance(next_node.value, ast.Constant)
            and isinstance(next_node.value.value, str)
        ):
            docs[field_node.target.id] = " ".join(inspect.cleandoc(next_node.value.value).split())
    return docs


def _limits(meta: typing.Mapping[str, Any]) -> str:
    parts = []
    if "min" in meta:
        parts.append(f">= {meta['min']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    if "allowed" in meta:
        parts.append(str(meta["allowed"]))
    return " and ".join(parts)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return _NO_DEFAULT
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    return repr(value) if isinstance(value, str) else str(value)


def _section_keys(cls: type, section: str) -> list[KeyDoc]:
    """The section's own keys, then its sub-tables' (so each renders as one table)."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    keys, tables = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        origin = typing.get_origin(tp)
        item = typing.get_args(tp)[0] if origin is list and typing.get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            tables += _section_keys(tp, f"{section}.{f.name}")
            continue
        if item is not None and dataclasses.is_dataclass(item):
            tables += _section_keys(item, f"{section}.{f.name}")
            continue
        table = _optional_table(tp)
        kind = "a table" if table else type_name(tp)
        meaning = docs.get(f.name, "")
        keys.append(KeyDoc(section, toml_key(f), kind, _default(f), _limits(f.metadata), meaning))
        if table:  # an optional sub-table: its row says what leaving it out means
            tables += _section_keys(table, f"{section}.{f.name}")
        elif (section, f.name) == ("rollout", "vllm"):
            tables += _vllm_keys()
    return keys + tables


def _optional_table(tp: Any) -> type | None:
    """The dataclass of a `Section | None` hint, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    tables = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
    return tables[0] if tables else None


def _vllm_keys() -> list[KeyDoc]:
    """[rollout.vllm]: our keys one by one, and one row for those vllm.LLM takes as written."""
    keys = [
        KeyDoc("rollout.vllm", key, doc.kind, doc.default, doc.allowed, doc.meaning)
        for key, doc in VLLM_OWN_KEYS.items()
    ]
    return [*keys, KeyDoc("rollout.vllm", "<any other>", "any", "see meaning", "", PASS_THROUGH)]


def _loss_keys() -> list[KeyDoc]:
    """[loss] keys beside `name`: TorchRL's loss keyword arguments and ours (`loss_values`),
    with the defaults the learner builds with (TorchRL's signature, or ours over it)."""
    keys, tables = [], []
    for key, rule in LOSS_KEYS.items():
        if dataclasses.is_dataclass(rule.kind):  # a sub-table ([loss.correction]): after [loss]
            tables += _section_keys(rule.kind, f"loss.{key}")
            continue
        refused = "; ".join(f"not {value!r}: {why}" for value, why in rule.refused.items())
        limits = " and ".join(filter(None, (_limits(rule.limits), refused)))
        default = "false" if rule.kind is bool and key not in _torchrl_keys() else None
        default = default or _loss_default(key)
        keys.append(KeyDoc("loss", key, type_name(rule.kind), default, limits, rule.doc))
    return keys + tables


def _torchrl_keys() -> set[str]:
    from titan_learner.config.validate import loss_class

    return set(inspect.signature(loss_class("grpo").__init__).parameters)


def _loss_default(key: str) -> str:
    """Ours where we set one, else TorchRL's GRPOLoss signature's (the other classes take the
    same), else unset (our own keys)."""
    from titan_learner.config.validate import loss_class

    if key in PROJECT_DEFAULTS:
        return repr(PROJECT_DEFAULTS[key])
    parameter = inspect.signature(loss_class("grpo").__init__).parameters.get(key)
    if parameter is None or parameter.default in (None, inspect.Parameter.empty):
        return "unset"
    value = parameter.default
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def config_reference() -> list[KeyDoc]:
    """Every key, section by section in the schema's order."""
    hints = typing.get_type_hints(Config)
    keys: list[KeyDoc] = []
    for section in SECTIONS:
        tp = hints[section]
        cls = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        section_keys = _section_keys(cls, section)
        if cls is LossSection:
            section_keys = [k for k in section_keys if k.key != "kwargs"] + _loss_keys()
        keys += section_keys
    return keys


def explain(name: str) -> str:
    """`check --explain KEY`: KEY as `section.key`, `[section] key` or a bare key if unique."""
    wanted = name.strip().replace("[", "").replace("]", " ").split()
    dotted = ".".join(wanted)
    keys = config_reference()
    found = [k for k in keys if k.name == dotted] or [k for k in keys if k.key == dotted]
    if len(found) == 1:
        return found[0].explain()
    names = [k.name for k in keys]
    if found:
        raise ConfigError(
            f"{name!r} is a key of several sections; allowed: one of "
            + ", ".join(k.name for k in found),
            source="--explain",
        )
    raise ConfigError(
        f"no key {name!r}{did_you_mean(dotted, names)}; allowed: section.key, e.g. "
        "rollout.group_size",
        source="--explain",
    )


def render_markdown(keys: list[KeyDoc]) -> str:
    """docs/config.md."""
    lines = [
        "# Configuration reference",
        "",
        "Every key of the TOML file, generated from the schema (`titan_learner/config/schema.py`)",
        "by `python scripts/config_reference.py`; a test fails when this file is out of date.",
        "`titan-learner check --explain KEY` prints one entry. Paths in `[tokenizer]`, `[data]` and",
        "`[[reward]]` are relative to the config file; `hf_checkpoint`, `model_path` and",
        "`output_dir` to the directory you launch from.",
    ]
    section = None
    for key in keys:
        if key.section != section:
            section = key.section
            lines += ["", f"## [{section}]", "", "| key | type | default | allowed | meaning |"]
            lines.append("|---|---|---|---|---|")
        cells = [f"`{key.key}`", key.kind, f"`{key.default}`", key.limits, key.meaning]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
