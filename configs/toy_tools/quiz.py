"""The multi-turn default's environment: the question names a sensor, the answer is its
current reading, which only a call to the tool in this episode tells (readings change with
every call, so no table of answers can be learned).

Reward of an episode, given when the model answers (a turn that is no tool call), from the
episode's last call and the tool's reply to it:
- 1 when the call named the question's sensor and the answer starts with the reply;
- otherwise partial credit, so that a policy from random weights finds the call and the
  reading: 0.1 for having called, 0.2 more when the call named the right sensor, 0.2 more when
  the answer starts with the reply. Neither part pays without the skill it stands for: a
  constant call earns the sensor's 0.2 on one question in ten, and a constant answer matches a
  fresh reading one time in ten.
- 0 without a call.
"""

from __future__ import annotations


class Quiz:
    def reset(self, row: dict) -> list[dict]:
        self.key = row["key"]
        return [{"role": "user", "content": self.key}]

    def step(self, messages: list[dict], completion: str) -> tuple[list[dict], float, bool]:
        turns = messages[1:-1]
        calls = [i for i, m in enumerate(turns) if m["role"] == "assistant"]
        if not calls:
            return [], 0.0, True
        last = calls[-1]
        key = turns[last]["content"].strip()
        reply = turns[last + 1]["content"] if last + 1 < len(turns) else None
        right_key = key == self.key
        read = reply is not None and completion.strip()[:1] == reply
        if right_key and read:
            return [], 1.0, True
        return [], 0.1 + 0.2 * right_key + 0.2 * read, True
