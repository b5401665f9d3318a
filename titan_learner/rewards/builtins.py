"""The built-in rewards: `math`, `exact_match`, `regex`.

Each is a function `score(prompt, completion, row) -> float` once configured (the answer column,
the pattern), the same signature a user reward has.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from titan_learner.noise import drop_log_messages

Score = Callable[[str, str, dict], float]
BUILTINS = ("math", "exact_match", "regex")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_MARK = "####"


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def final_answer(text: str) -> str | None:
    r"""A completion's final answer: the last `\boxed{}`, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gold_answer(answer: Any) -> str:
    """The reference answer as text; a GSM8K solution keeps what follows its last '####'."""
    text = str(answer)
    return text.rsplit(_GSM8K_MARK, 1)[1].strip() if _GSM8K_MARK in text else text.strip()


def _quiet_math_verify() -> None:
    """Our runner times every reward out, so math-verify's own (signal-based, main-thread-only)
    timeouts are off; its one-time warning about that says nothing a user can act on."""
    for name in ("math_verify.parser", "math_verify.grader"):
        drop_log_messages(name, "Timeout is disabled")


@functools.cache
def _math_verify() -> tuple[Callable, Callable]:
    from math_verify import parse, verify

    _quiet_math_verify()
    return parse, verify


def math_reward(prompt: str, completion: str, row: dict, *, answer_key: str) -> float:
    r"""1.0 when the completion's final answer (`\boxed{}` or the last number) equals the row's
    answer mathematically (math-verify: 1/2 = 0.5 = \frac{1}{2}, 1,234 = 1234), else 0.0."""
    parse, verify = _math_verify()
    predicted = final_answer(completion)
    if predicted is None:
        return 0.0
    gold = parse(f"\\boxed{{{gold_answer(row[answer_key])}}}", parsing_timeout=None)
    guess = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0


def exact_match_reward(prompt: str, completion: str, row: dict, *, answer_key: str) -> float:
    """1.0 when the completion equals the row's answer, whitespace collapsed, else 0.0."""
    return 1.0 if " ".join(completion.split()) == " ".join(str(row[answer_key]).split()) else 0.0


def regex_reward(
    prompt: str, completion: str, row: dict, *, pattern: re.Pattern, mode: str, credit: float
) -> float:
    """`credit` when the completion matches (anywhere, or as a whole), else 0.0."""
    match = pattern.fullmatch(completion) if mode == "fullmatch" else pattern.search(completion)
    return credit if match else 0.0


def builtin(name: str, *, answer_key: str, pattern: str | None, mode: str, credit: float) -> Score:
    """A configured built-in reward; `pattern` must compile for `regex` (re.error otherwise)."""
    if name == "math":
        return functools.partial(math_reward, answer_key=answer_key)
    if name == "exact_match":
        return functools.partial(exact_match_reward, answer_key=answer_key)
    compiled = re.compile(pattern or "", re.DOTALL)
    return functools.partial(regex_reward, pattern=compiled, mode=mode, credit=credit)
