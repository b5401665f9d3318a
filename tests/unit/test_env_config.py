"""[env] and [[tool]] as a user writes them: `class` (a Python keyword, the field `class_`) reads,
writes back and is documented under the key the user writes."""

from __future__ import annotations

import tomllib

import pytest

from titan_learner.config.env_values import multi_turn
from titan_learner.config.errors import ConfigError
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


def parts_of(tmp_path, text: str):
    from titan_learner.job.episodes import load_env_parts

    (tmp_path / "tools.py").write_text("def lookup(key: str) -> str:\n    return key\n")
    (tmp_path / "envs.py").write_text("class Lookup:\n    def reset(self, row): ...\n")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_env_parts(load_config(path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[env]\nclass = "missing.py:Env"\n',
            "[env] class: 'missing.py:Env': file {root}/missing.py not found",
        ),
        (
            '[env]\nclass = "envs.py:Lookup"\n',
            "[env] class: 'envs.py:Lookup': Lookup has no step; an environment has reset(row) -> "
            "messages and step(messages, completion) -> (messages, reward, done)",
        ),
        (
            '[[tool]]\nfunction = "tools.py:lookup"\n\n[[tool]]\nfunction = "tools.py:lookup"\n',
            "[[tool]] #2 function: 'tools.py:lookup': another [[tool]] has its name; allowed: one "
            "tool a name",
        ),
        (
            '[env]\ntool_parser = "tools.py:nope"\n\n[[tool]]\nfunction = "tools.py:lookup"\n',
            "[env] tool_parser: 'tools.py:nope': tools.py has no attribute 'nope'",
        ),
    ],
)
def test_what_cannot_be_loaded_is_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as raised:
        parts_of(tmp_path, text)
    assert str(raised.value) == f"{tmp_path / 'run.toml'}: " + message.format(root=tmp_path)


def test_a_user_parser_is_loaded_with_the_tools(tmp_path):
    parts = parts_of(
        tmp_path,
        '[env]\ntool_parser = "tools.py:lookup"\n\n[[tool]]\nfunction = "tools.py:lookup"\n',
    )
    assert list(parts.tools) == ["lookup"] and parts.make_env is None
    assert parts.parser is not None


def test_a_whole_episode_must_fit_the_model_and_a_token_budget():
    from titan_learner.job.checks import check_sequence_length

    tool = [{"function": "tools.py:lookup"}]
    sized = config_from_dict({"tool": tool, "env": {"max_total_tokens": 300}}, source="run.toml")
    with pytest.raises(ConfigError) as longer:
        check_sequence_length(sized, 256)
    assert str(longer.value) == (
        "run.toml: [env] max_total_tokens: max_total_tokens = 300 positions, but the model covers "
        "256 (max_seq_len); allowed: a smaller max_total_tokens, or a larger [model.overrides] "
        "max_seq_len"
    )
    check_sequence_length(sized, 300)
    derived = config_from_dict(
        {
            "tool": tool,
            "learner": {"max_tokens_per_microbatch": 90},
            "data": {"max_prompt_tokens": 64},
        },
        source="run.toml",
    )
    with pytest.raises(ConfigError) as budget:
        check_sequence_length(derived, 4096)
    assert str(budget.value) == (
        "run.toml: [learner] max_tokens_per_microbatch: max_tokens_per_microbatch = 90 is "
        "shorter than the longest episode ([env] max_total_tokens = 0: max_prompt_tokens + "
        "max_turns x max_new_tokens = 96); allowed: at least 96"
    )
