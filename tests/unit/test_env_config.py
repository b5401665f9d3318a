"""[env] and [[tool]] as a user writes them: `class` (a Python keyword, the field `class_`) reads,
writes back and is documented under the key the user writes."""

from __future__ import annotations

import tomllib

from titan_learner.config.env_values import multi_turn
from titan_learner.config.reference import explain
from titan_learner.config.toml import config_from_dict, config_to_toml, load_config

TEXT = """
[env]
class = "envs.py:Lookup"
max_turns = 3
max_total_tokens = 96
step_timeout_s = 2.5
tool_parser = "parsers.py:mine"

[[tool]]
function = "tools.py:lookup"

[[tool]]
function = "package.tools:calculator"
"""


def test_env_and_tools_read_and_write_back(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TEXT)
    config = load_config(path)
    assert config.env.class_ == "envs.py:Lookup"
    assert (config.env.max_turns, config.env.max_total_tokens) == (3, 96)
    assert config.env.step_timeout_s == 2.5 and config.env.tool_parser == "parsers.py:mine"
    assert [t.function for t in config.tool] == ["tools.py:lookup", "package.tools:calculator"]
    text = config_to_toml(config)
    assert 'class = "envs.py:Lookup"' in text and text.count("[[tool]]") == 2
    again = config_from_dict(tomllib.loads(text), source=str(path))
    assert again.env == config.env and again.tool == config.tool
    assert multi_turn(config)


def test_single_turn_is_the_default():
    config = config_from_dict({})
    assert config.env.class_ is None and config.tool == [] and not multi_turn(config)
    assert multi_turn(config_from_dict({"tool": [{"function": "tools.py:f"}]}))


def test_explain_names_the_key_the_user_writes():
    assert explain("env.class").startswith("[env] class\n  type:    a string\n  default: unset")
