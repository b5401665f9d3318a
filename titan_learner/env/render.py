"""Token-in/token-out rendering: the first prompt once, then each environment turn as a delta
of token ids appended after the model's sampled tokens, so that nothing sampled is ever
re-encoded (re-encoding text can give other ids than the sampled ones, and the trained
log-probs would no longer be those of the tokens the generator drew).

A delta is rendered after a fixed context that ends with an assistant turn holding a marker,
not after the real conversation: templates render earlier turns differently as the
conversation grows (Qwen3 drops the thinking of turns before the last user message, and adds
an empty one to a last assistant turn), which would change text already sampled. What follows
the marker is the template's closing of the assistant turn (e.g. `<|im_end|>\n`), the new
messages and the next generation prompt; the EOS the model sampled is the start of that
closing, so it is left out and the rest is appended.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MARKER = "\x00titan-learner-turn\x00"
CACHE_ENTRIES = 65536
CONTEXT = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARKER}]


class RenderError(ValueError):
    """The chat template cannot render turns as deltas: what it did instead."""


@dataclass(frozen=True)
class ChatRenderer:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str
    tools: list[dict[str, Any]] | None
    """The tools' JSON schemas for the template's tools= (None: no tools)."""

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def encode(self, text: str) -> list[int]:
        # A chat template writes the special tokens (BOS included) itself.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    _rendered: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)
    """Ids by what was rendered: a step renders the same tool results and first prompts for
    many episodes (G per prompt), and a template render costs more than a turn of a tiny model."""

    def first(self, messages: list[dict[str, Any]]) -> list[int]:
        """The episode's first prompt, with the generation prompt."""
        return self._cached(("first", messages), lambda: self._first(messages))

    def delta(self, new_messages: list[dict[str, Any]], sampled_eos: int | None) -> list[int]:
        """The ids that follow a sampled assistant turn ending with `sampled_eos`: the rest of
        the template's closing of the turn, `new_messages`, the next generation prompt."""
        return self._cached(
            ("delta", new_messages, sampled_eos), lambda: self._delta(new_messages, sampled_eos)
        )

    def _cached(self, key: Any, make: Callable[[], list[int]]) -> list[int]:
        text = json.dumps(key, sort_keys=True, default=repr)
        if text not in self._rendered:
            if len(self._rendered) >= CACHE_ENTRIES:
                self._rendered.clear()
            self._rendered[text] = make()
        return list(self._rendered[text])

    def _first(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, generation_prompt=True))

    def _delta(self, new_messages: list[dict[str, Any]], sampled_eos: int | None) -> list[int]:
        closing = self._after_marker(self.render(CONTEXT, generation_prompt=False))
        following = self._after_marker(self.render(CONTEXT + new_messages, generation_prompt=True))
        if not following.startswith(closing):
            raise RenderError(
                "the chat template closes an assistant turn differently when messages follow it "
                f"({closing!r}, then {following[: len(closing)]!r}): turns cannot be appended "
                "as deltas without changing sampled text"
            )
        if sampled_eos is not None:
            eos_text = self.tokenizer.convert_ids_to_tokens(sampled_eos)
            following = following.removeprefix(eos_text)
        return self.encode(following)

    @staticmethod
    def _after_marker(text: str) -> str:
        start = text.find(MARKER)
        if start < 0:
            raise RenderError(
                "the chat template does not write an assistant message's content as given: "
                "turns cannot be appended as deltas"
            )
        return text[start + len(MARKER) :]
