"""The multi-turn default's tool: a secret table from two-letter keys to digits."""

from __future__ import annotations

import random

LETTERS = "abcdefghij"
_DIGITS = random.Random(37)
TABLE = {a + b: str(_DIGITS.randrange(10)) for a in LETTERS for b in LETTERS}


def lookup(key: str) -> str:
    """The digit stored under a key.

    key: two letters from a to j
    """
    return TABLE[key]
