"""The embedded default's files (configs/toy): tokenizer, prompts, eval split and reward.

They ship in the repository and go through the same path as a user's model, data and reward;
scripts/make_toy_data.py rebuilds them byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.toy import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SEP_ID,
    TOY,
    VOCAB_SIZE,
    reward_module,
    tokenizer,
)

ROOT = TOY.parents[1]


def score(completion: str, answer: str = "01234") -> float:
    return reward_module().score("42310", completion, {"answer": answer})


def test_tokenizer_ids_and_framing():
    t = tokenizer()
    assert len(t) == VOCAB_SIZE
    assert (t.pad_token_id, t.bos_token_id, t.sep_token_id, t.eos_token_id) == (
        PAD_ID,
        BOS_ID,
        SEP_ID,
        EOS_ID,
    )
    assert t("42310")["input_ids"] == [BOS_ID, 4, 2, 3, 1, 0, SEP_ID]
    ids = [0, 3, 9, EOS_ID, PAD_ID, BOS_ID, SEP_ID]
    assert t.decode(ids, skip_special_tokens=False) == "039<eos><pad><bos><sep>"
    assert t.decode(ids, skip_special_tokens=True) == "039"


def test_reward_hand_cases():
    """Partial credit: the fraction of the target's positions (sorted digits, then <eos>) right."""
    assert score("01234<eos>") == 1.0  # perfect
    assert score("012999") == 0.5  # 3 of 6, no <eos>
    assert score("012434") == 0.5
    assert score("") == 0.0  # empty
    assert score("<eos>") == 0.0  # stops at once
    assert score("01234") == pytest.approx(5 / 6)  # missing <eos>
    assert score("012344<eos>") == pytest.approx(5 / 7)  # an extra digit widens the denominator
    assert score("01234<eos>77") == 1.0  # what follows the first <eos> is ignored
    assert score("01<eos>234") == pytest.approx(2 / 6)  # an early <eos> ends the response
    assert score("01<pad>34<eos>") == pytest.approx(5 / 6)  # a special token is a wrong position


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TOY / name).read_text().splitlines()]


def test_prompt_files_are_sorting_problems_with_a_disjoint_eval_split():
    train, held_out = rows("sort_train.jsonl"), rows("sort_eval.jsonl")
    assert (len(train), len(held_out)) == (4096, 256)
    for row in train + held_out:
        assert 4 <= len(row["prompt"]) <= 6 and row["prompt"].isdigit()
        assert row["answer"] == "".join(sorted(row["prompt"]))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_the_script_rebuilds_the_shipped_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_toy_data.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in ("sort_train.jsonl", "sort_eval.jsonl", "tokenizer/tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (TOY / name).read_bytes(), name
