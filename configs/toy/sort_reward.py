"""The embedded default's reward: partial credit for sorting 4-6 digits ascending.

score(prompt, completion, row) is the fraction of response positions that are right, so an
early policy that gets some digits in place already has a gradient (a 0/1 reward on 4-6 digits
is almost never 1 at the start). The target is the sorted digits (`row["answer"]`), then <eos>:

- position i of the response is right when it equals position i of the target;
- the denominator is max(len(target), len(response)), so extra tokens cost credit;
- <eos> is part of the answer: a response that stops at max_new_tokens without it loses that
  position, and a perfect score needs it;
- tokens after the first <eos> are ignored (the generator stops there);
- an empty response scores 0.

The completion arrives with its special tokens (`[tokenizer] skip_special_tokens = false`), so
<eos>, and any <pad>, <bos> or <sep> the policy samples, are positions like the digits.
"""

from __future__ import annotations

import re

TOKENS = re.compile(r"<eos>|<pad>|<bos>|<sep>|\d")
EOS = "<eos>"


def score(prompt: str, completion: str, row: dict) -> float:
    target = [*row["answer"], EOS]
    response = TOKENS.findall(completion)
    if EOS in response:
        response = response[: response.index(EOS) + 1]
    right = sum(a == b for a, b in zip(response, target, strict=False))
    return right / max(len(target), len(response))
