"""Tools as a user writes them: a plain function's JSON schema from its signature and docstring,
tool calls read in Qwen3/Hermes, Llama 3 and a user's format, and every failure of a tool
(unknown, malformed, raising, hanging) answered to the model as a tool message."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import pytest

from titan_learner.env.loading import EnvLoadError
from titan_learner.env.tool_calls import ToolCall, parse_hermes, parse_llama3, tool_parser
from titan_learner.env.tools import Tool, answer, load_tools, tool_schema

TOOLS_PY = '''
def lookup(key: str, default: int = 0) -> str:
    """Look a key up in the table.

    Args:
        key: the key to look up
        default (int): what a missing key gives
    """
    return {"a": "1"}.get(key, str(default))


def slow(seconds: float) -> str:
    """Sleep."""
    import time
    time.sleep(seconds)
    return "done"


def broken() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire")
'''


def calculator(
    expression: str, precision: int | None = None, mode: Literal["exact", "float"] = "float"
) -> float:
    """Evaluate an arithmetic expression.

    expression: digits and + - * /
    precision: decimals kept
    """
    value = eval(expression, {"__builtins__": {}})
    return round(value, precision) if precision is not None else value


def test_schema_from_signature_and_docstring():
    assert tool_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "digits and + - * /"},
                    "precision": {"type": "integer", "description": "decimals kept"},
                    "mode": {"type": "string", "enum": ["exact", "float"]},
                },
                "required": ["expression"],
            },
        },
    }


@pytest.fixture
def tools(tmp_path: Path) -> dict[str, Tool]:
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    return load_tools(["tools.py:lookup", "tools.py:slow", "tools.py:broken"], tmp_path)


def test_google_style_args_and_a_file_tool(tools):
    schema = tools["lookup"].schema["function"]
    assert schema["description"] == "Look a key up in the table."
    assert schema["parameters"]["properties"] == {
        "key": {"type": "string", "description": "the key to look up"},
        "default": {"type": "integer", "description": "what a missing key gives"},
    }
    assert schema["parameters"]["required"] == ["key"]


def test_hermes_calls_anywhere_in_the_turn():
    text = (
        'Let me look. <tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>'
    )
    assert parse_hermes(text) == [
        ToolCall("lookup", {"key": "a"}),
        ToolCall("calculator", {"expression": "1+2"}),
    ]
    assert parse_hermes("The answer is 4.") == []
    (bad,) = parse_hermes("<tool_call>{name: lookup}</tool_call>")
    assert bad.name == "" and bad.error.startswith("the tool call is not JSON")
    (unclosed,) = parse_hermes('<tool_call>{"name": "lookup", "arguments": {"key": "b"}}')
    assert unclosed == ToolCall("lookup", {"key": "b"})


def test_llama3_json_calls():
    assert parse_llama3('{"name": "lookup", "parameters": {"key": "a"}}') == [
        ToolCall("lookup", {"key": "a"})
    ]
    assert parse_llama3('<|python_tag|>{"name": "f", "parameters": {}}<|eom_id|>') == [
        ToolCall("f", {})
    ]
    assert parse_llama3(
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    ) == [ToolCall("f", {"x": 1}), ToolCall("g", {})]
    assert parse_llama3("The answer is 4.") == []
    assert parse_llama3('{"answer": 4}') == []  # JSON, but no call


def test_auto_follows_the_template_and_a_user_parser_is_a_hook(tmp_path):
    assert tool_parser("auto", "...{{ '<tool_call>' }}...", tmp_path) is parse_hermes
    assert tool_parser("auto", "{{ messages }}", tmp_path) is parse_llama3
    (tmp_path / "mine.py").write_text(
        "def parse(text):\n    return [{'name': 'lookup', 'arguments': {'key': text.strip()}}]\n"
    )
    assert tool_parser("mine.py:parse", None, tmp_path)("a ") == [ToolCall("lookup", {"key": "a"})]
    with pytest.raises(EnvLoadError, match="has no attribute 'nope'"):
        tool_parser("mine.py:nope", None, tmp_path)


def test_a_tool_answers_with_its_result(tools):
    done = answer(tools, ToolCall("lookup", {"key": "a"}), timeout_s=5)
    assert done.message == {"role": "tool", "name": "lookup", "content": "1"} and not done.error


@pytest.mark.parametrize(
    ("call", "content"),
    [
        (ToolCall("search", {}), "error: no tool named 'search'; tools: lookup, slow, broken"),
        (ToolCall("lookup", {"ke": "a"}), "error: lookup: missing a required argument: 'key'"),
        (ToolCall("broken", {}), "error: broken raised RuntimeError: disk on fire"),
        (ToolCall("", error="the tool call is not JSON"), "error: the tool call is not JSON"),
    ],
)
def test_a_failing_call_is_an_error_message_not_a_crash(tools, call, content):
    done = answer(tools, call, timeout_s=5)
    assert done.error and done.message["content"] == content and done.message["role"] == "tool"


def test_a_hung_tool_is_abandoned_at_the_timeout(tools):
    start = time.perf_counter()
    done = answer(tools, ToolCall("slow", {"seconds": 5}), timeout_s=0.2)
    assert time.perf_counter() - start < 2
    assert done.error and done.message["content"] == "error: slow did not return within 0.2 s"


def test_two_tools_of_one_name_are_refused(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    with pytest.raises(EnvLoadError, match="another \\[\\[tool\\]\\] is also named 'lookup'"):
        load_tools(["tools.py:lookup", "tools.py:lookup"], tmp_path)
