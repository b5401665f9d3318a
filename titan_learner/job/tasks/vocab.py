"""The digit vocabulary, defined once: token ids, and the tokenizer built from them.

Token id d is the digit d (0-9), so a digit task reads its digits straight off the ids; the four
specials follow. Nothing here is downloaded: the embedded default trains a model whose vocabulary
is exactly these 14 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_DIGITS = 10
PAD_ID = 10
BOS_ID = 11
SEP_ID = 12
EOS_ID = 13
VOCAB_SIZE = 14

SPECIAL_TOKENS: dict[int, str] = {
    PAD_ID: "<pad>",
    BOS_ID: "<bos>",
    SEP_ID: "<sep>",
    EOS_ID: "<eos>",
}
_SPECIAL_IDS = {text: token for token, text in SPECIAL_TOKENS.items()}


def is_digit(token: int) -> bool:
    return 0 <= token < NUM_DIGITS


def decode(ids: Sequence[int]) -> str:
    """Text for display: digits as characters, specials as `<name>`, e.g. `<bos>3021<sep>`."""
    parts = []
    for token in ids:
        token = int(token)
        if is_digit(token):
            parts.append(str(token))
        elif token in SPECIAL_TOKENS:
            parts.append(SPECIAL_TOKENS[token])
        else:
            raise ValueError(f"token id {token} is outside the digit vocabulary [0, {VOCAB_SIZE})")
    return "".join(parts)


def encode(text: str) -> list[int]:
    """The inverse of `decode`: `encode(decode(ids)) == ids` for any ids of the vocabulary."""
    ids: list[int] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isdigit():
            ids.append(int(char))
            i += 1
            continue
        end = text.find(">", i)
        name = text[i : end + 1] if char == "<" and end != -1 else None
        if name not in _SPECIAL_IDS:
            raise ValueError(
                f"cannot encode {text[i:]!r} at offset {i}: expected a digit or one of "
                + ", ".join(_SPECIAL_IDS)
            )
        ids.append(_SPECIAL_IDS[name])
        i = end + 1
    return ids
