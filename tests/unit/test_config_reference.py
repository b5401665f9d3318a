"""The configuration reference is generated from the schema: docs/config.md must be what the
code accepts today, and `check --explain KEY` prints one entry or one line naming the choices."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from titan_learner.config.errors import ConfigError
from titan_learner.config.reference import config_reference, explain, render_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_up_to_date():
    assert (ROOT / "docs/config.md").read_text() == render_markdown(config_reference()), (
        "docs/config.md is out of date: run python scripts/config_reference.py"
    )


def test_every_key_a_user_writes_is_in_the_reference():
    from titan_learner.config.loss_values import LOSS_KEYS

    names = [key.name for key in config_reference()]
    assert len(names) == len(set(names))
    assert {"rollout.group_size", "model.overrides.dim", "reward.function"} <= set(names)
    assert "loss.kwargs" not in names  # [loss] keys are written plainly: the loss's own
    for key, rule in LOSS_KEYS.items():  # a sub-table's keys are listed one by one
        prefix = f"loss.{key}" + ("." if dataclasses.is_dataclass(rule.kind) else "")
        assert any(name.startswith(prefix) for name in names), key


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


def test_check_explain_on_the_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "titan_learner", "check", "--explain", "run.steps"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.startswith("[run] steps\n"), done.stderr
