"""Tool calls read from a completion's text, in the format the model's chat template teaches:

- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, anywhere in the turn;
- llama3 (Llama 3.1+ JSON tool calling): the whole turn is one JSON object
  `{"name": ..., "parameters": {...}}` (or several joined by `;`), after an optional
  `<|python_tag|>`;
- a user function `parse(text) -> list[{"name": ..., "arguments": {...}}]`.

A call that names a tool but cannot be read (bad JSON, arguments not an object) is kept, with
its `error`: the model is told what was wrong instead of the turn silently counting as an answer.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_learner.env.loading import EnvLoadError, load_object

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
HERMES_MARK = "<tool_call>"

Parser = Callable[[str], "list[ToolCall]"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read; None for a well-formed call."""


def call_from_json(text: str, arguments_key: str) -> ToolCall:
    """One call from its JSON text: {"name": ..., arguments_key: {...} or a JSON string}."""
    try:
        value = json.loads(text)
    except ValueError as err:
        return ToolCall("", error=f"the tool call is not JSON ({err}): {text.strip()[:200]}")
    return call_from_value(value, arguments_key)


def call_from_value(value: Any, arguments_key: str) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(
            "",
            error=f'a tool call is {{"name": ..., "{arguments_key}": {{...}}}}, got {value!r}'[
                :300
            ],
        )
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: reported as not an object below
            arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ToolCall(
            value["name"], error=f"{arguments_key} must be a JSON object, got {arguments!r}"[:300]
        )
    return ToolCall(value["name"], arguments)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` (an unclosed last one too) in the turn."""
    return [call_from_json(body, "arguments") for body in _HERMES.findall(text)]


def parse_llama3(text: str) -> list[ToolCall]:
    """The turn as JSON tool calls, when it is nothing else; [] for a plain answer."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    for end in ("<|eot_id|>", "<|eom_id|>"):
        body = body.removesuffix(end).strip()
    if not body.startswith("{"):
        return []
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict):  # one call, or an answer that happens to be JSON
        return [call_from_value(value, "parameters")] if "name" in value else []
    parts = [part for part in body.split(";") if part.strip()]
    return [call_from_json(part, "parameters") for part in parts]


def tool_parser(choice: str, chat_template: str | None, base_dir: Path) -> Parser:
    """[env] tool_parser as a function: auto reads the chat template's convention."""
    if choice == "auto":
        choice = "hermes" if chat_template and HERMES_MARK in chat_template else "llama3"
    if choice == "hermes":
        return parse_hermes
    if choice == "llama3":
        return parse_llama3
    user = load_object(choice, base_dir)
    if not callable(user):
        raise EnvLoadError(f"{choice!r} is a {type(user).__name__}, not a function")
    return lambda text: [
        call if isinstance(call, ToolCall) else call_from_value(call, "arguments")
        for call in user(text)
    ]
