"""Tools: plain Python functions the model may call, described to the chat template by a JSON
schema made from their signature and docstring, and called so that nothing they do (raise,
hang, return something odd) stops the run: the model reads the error as the tool's answer."""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from titan_learner.env.loading import EnvLoadError, load_object
from titan_learner.env.timeout import CallTimeout, call_with_timeout
from titan_learner.env.tool_calls import ToolCall

JSON_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}
_ARGUMENT_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    """{"type": "function", "function": {name, description, parameters}}: what `tools=` takes."""


def json_type(hint: Any) -> dict[str, Any]:
    """The JSON schema of a parameter's type hint; {} (anything) where there is none to say."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        values = list(typing.get_args(hint))
        return {"type": JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (typing.Union, types.UnionType):
        present = [a for a in typing.get_args(hint) if a is not type(None)]
        return json_type(present[0]) if len(present) == 1 else {}
    if origin in (list, tuple):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return {"type": "array", **({"items": json_type(args[0])} if len(set(args)) == 1 else {})}
    if origin is dict:
        return {"type": "object"}
    return {"type": JSON_TYPES[hint]} if hint in JSON_TYPES else {}


def describe(function: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The docstring's first paragraph, and `name: meaning` lines (Google's `Args:` style too)
    for the parameters."""
    doc = inspect.cleandoc(function.__doc__ or "")
    paragraphs = doc.split("\n\n")
    summary = " ".join(paragraphs[0].split()) if doc else ""
    parameters = set(inspect.signature(function).parameters)
    meanings = {}
    for line in doc.splitlines()[1:]:
        match = _ARGUMENT_LINE.match(line)
        if match and match[1] in parameters:
            meanings[match[1]] = match[2].strip()
    return summary, meanings


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it (OpenAI's tool format)."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)
    summary, meanings = describe(function)
    properties, required = {}, []
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[name] = json_type(hints.get(name))
        if name in meanings:
            properties[name]["description"] = meanings[name]
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": function.__name__,
            "description": summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def load_tools(specs: list[str], base_dir: Path) -> dict[str, Tool]:
    """The [[tool]] functions by name; EnvLoadError for one that is no function or whose name
    another tool has."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        function = load_object(spec, base_dir)
        if not inspect.isfunction(function) and not inspect.isbuiltin(function):
            raise EnvLoadError(f"{spec!r} is a {type(function).__name__}, not a function")
        name = function.__name__
        if name in tools:
            raise EnvLoadError(
                f"{spec!r}: another [[tool]] is also named {name!r}; allowed: one tool a name"
            )
        tools[name] = Tool(name, function, tool_schema(function))
    return tools


@dataclass(frozen=True)
class ToolAnswer:
    message: dict[str, str]
    """{"role": "tool", "name": ..., "content": ...}: the result, or what went wrong."""
    error: bool


def answer(tools: dict[str, Tool], call: ToolCall, timeout_s: float) -> ToolAnswer:
    """The tool message that answers `call`. An unknown tool, a malformed call, arguments the
    function does not take, an exception or an overrun is an error message, not a crash."""

    def error(text: str) -> ToolAnswer:
        return ToolAnswer({"role": "tool", "name": call.name, "content": f"error: {text}"}, True)

    if call.error is not None:
        return error(call.error)
    tool = tools.get(call.name)
    if tool is None:
        return error(f"no tool named {call.name!r}; tools: {', '.join(tools) or 'none'}")
    try:
        inspect.signature(tool.function).bind(**call.arguments)
    except TypeError as err:
        return error(f"{call.name}: {err}")
    try:
        result = call_with_timeout(tool.function, (), call.arguments, timeout_s)
    except CallTimeout as err:
        return error(f"{call.name} {err}")
    except Exception as err:
        return error(f"{call.name} raised {type(err).__name__}: {err}")
    content = result if isinstance(result, str) else json.dumps(result, default=str)
    return ToolAnswer({"role": "tool", "name": call.name, "content": content}, False)
