"""The multi-turn default's tool-call format ([env] tool_parser): a turn that is exactly one
letter a-j calls lookup with it as the key (the tiny model's vocabulary has no JSON)."""

from __future__ import annotations

import re

CALL = re.compile(r"[a-j]")


def parse(text: str) -> list[dict]:
    text = text.strip()
    return [{"name": "lookup", "arguments": {"key": text}}] if CALL.fullmatch(text) else []
