"""The configuration reference is generated from the schema: docs/config.md must be what the
code accepts today, and `check --explain KEY` prints one entry or one line naming the choices."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from titan_learner.config.errors import ConfigError
from titan_learner.config.reference import config_reference, explain, render_markdown
from titan_learner.config.tables import toml_key

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_up_to_date():
    assert (ROOT / "docs/config.md").read_text() == render_markdown(config_reference()), (
        "docs/config.md is out of date: run python scripts/config_reference.py"
    )


def _schema_keys(cls: type, section: str) -> set[str]:
    """Every key a user can write under `section`, walked from the schema's dataclasses,
    optional sub-tables (`wandb = { ... }`) included."""
    hints = typing.get_type_hints(cls)
    names = set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        tables = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if tables:
            names |= _schema_keys(tables[0], f"{section}.{f.name}")
        else:
            names.add(f"{section}.{toml_key(f)}")
    return names


def test_every_key_a_user_writes_is_in_the_reference():
    from titan_learner.config.loss_values import LOSS_KEYS
    from titan_learner.config.schema import SECTIONS, Config, LossSection
    from titan_learner.vllm.serve import OWN_KEYS

    names = [key.name for key in config_reference()]
    assert len(names) == len(set(names))
    hints = typing.get_type_hints(Config)
    for section in SECTIONS:
        tp = hints[section]
        cls = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        written = _schema_keys(cls, section) - ({"loss.kwargs"} if cls is LossSection else set())
        assert written <= set(names), sorted(written - set(names))
    assert {"logging.wandb.project", "logging.wandb.mode", "logging.wandb.tags"} <= set(names)
    assert {f"rollout.vllm.{key}" for key in OWN_KEYS} <= set(names)
    assert "loss.kwargs" not in names  # [loss] keys are written plainly: the loss's own
    for key, rule in LOSS_KEYS.items():  # a sub-table's keys are listed one by one
        prefix = f"loss.{key}" + ("." if dataclasses.is_dataclass(rule.kind) else "")
        assert any(name.startswith(prefix) for name in names), key


def test_rollout_vllm_keys_allow_what_the_checks_allow():
    from titan_learner.vllm.backends import WEIGHT_TRANSFERS
    from titan_learner.vllm.engine_sleep import SLEEP_LEVELS

    keys = {key.key: key for key in config_reference() if key.section == "rollout.vllm"}
    assert keys["weight_transfer"].kind == "one of " + ", ".join(map(repr, WEIGHT_TRANSFERS))
    assert keys["sleep_level"].limits.startswith(" or ".join(map(str, SLEEP_LEVELS)) + ";")
    assert "keyword argument of `vllm.LLM`" in keys["<any other>"].meaning


def test_every_key_says_what_it_means():
    assert [key.name for key in config_reference() if not key.meaning] == []


def test_explain_prints_type_default_limits_and_meaning():
    assert explain("rollout.group_size") == (
        "[rollout] group_size\n"
        "  type:    an integer\n"
        "  default: 16\n"
        "  allowed: >= 2\n"
        "\n"
        "  G completions per prompt; group-relative advantages need at least 2."
    )
    assert explain("[rollout] group_size") == explain("group_size")
    assert explain("logging.wandb.mode") == (
        "[logging.wandb] mode\n"
        "  type:    one of 'online', 'offline', 'disabled'\n"
        "  default: 'online'\n"
        "\n"
        "  offline: written under <output_dir>/wandb for `wandb sync` later; disabled: no run."
    )


def test_explain_of_an_unknown_or_ambiguous_key_is_one_line():
    with pytest.raises(ConfigError) as unknown:
        explain("rollout.gruop_size")
    assert str(unknown.value) == (
        "--explain: no key 'rollout.gruop_size' (did you mean 'rollout.group_size'?); allowed: "
        "section.key, e.g. rollout.group_size"
    )
    with pytest.raises(ConfigError) as ambiguous:
        explain("temperature")
    assert str(ambiguous.value) == (
        "--explain: 'temperature' is a key of several sections; allowed: one of "
        "rollout.temperature, eval.temperature"
    )


@pytest.mark.parametrize(
    ("key", "heading"),
    [
        ("run.steps", "[run] steps"),
        ("logging.wandb.project", "[logging.wandb] project"),
        ("rollout.vllm.token_file", "[rollout.vllm] token_file"),
    ],
)
def test_check_explain_on_the_command_line(key, heading):
    done = subprocess.run(
        [sys.executable, "-m", "titan_learner", "check", "--explain", key],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.startswith(heading + "\n"), done.stderr
