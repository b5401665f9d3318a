"""The multi-turn default's environment: the question is a key, the answer the digit the tool
stores under it, which is not in the prompt.

Reward of an episode, given when the model answers (a turn that is no tool call):
- 1 when the answer starts with the right digit;
- 0.1 for having called the tool, and 0.1 for each letter of the key it called with that is
  right: partial credit, so that a policy starting from random weights finds the call (a 0/1
  reward on the answer alone would almost never come through the tool at the start).
"""

from __future__ import annotations


class Quiz:
    def reset(self, row: dict) -> list[dict]:
        self.key, self.answer = row["key"], row["answer"]
        return [{"role": "user", "content": self.key}]

    def step(self, messages: list[dict], completion: str) -> tuple[list[dict], float, bool]:
        calls = [m["content"] for m in messages[1:-1] if m["role"] == "assistant"]
        credit = 0.0
        if calls:
            call = calls[0].strip()
            credit = 0.1 + 0.1 * sum(a == b for a, b in zip(call, self.key, strict=False))
        return [], float(completion.strip()[:1] == self.answer) + credit, True
