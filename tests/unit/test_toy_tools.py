"""The multi-turn default's files (configs/toy_tools): a character tokenizer with a chat
template, lookup questions whose answers only the tool knows, the tool-call parser and the
environment's reward; scripts/make_toy_tools_data.py rebuilds them byte for byte."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "configs" / "toy_tools"


def module(name: str):
    spec = importlib.util.spec_from_file_location(f"toy_tools_{name}", TOY / f"{name}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOY / "tokenizer"), local_files_only=True)


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TOY / name).read_text().splitlines()]


def test_one_token_a_character_and_the_chat_template(tokenizer):
    assert len(tokenizer) == 28
    chat = [
        {"role": "user", "content": "cf"},
        {"role": "assistant", "content": "cf"},
        {"role": "tool", "content": "7"},
    ]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><user>cf<sep><assistant>cf<eos><tool>7<sep><assistant>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 13 and tokenizer.decode(ids) == text


def test_the_answers_are_the_tools_and_the_eval_keys_are_held_out():
    table = module("tools").TABLE
    train, held_out = rows("train.jsonl"), rows("eval.jsonl")
    assert (len(train), len(held_out)) == (80, 20)
    assert all(row["answer"] == table[row["key"]] for row in train + held_out)
    assert not {r["key"] for r in train} & {r["key"] for r in held_out}


def test_a_turn_of_two_letters_is_a_call():
    parse = module("parse").parse
    assert parse("cf") == [{"name": "lookup", "arguments": {"key": "cf"}}]
    assert parse("7") == [] and parse("cfa") == [] and parse("c7") == []


@pytest.mark.parametrize(
    ("turns", "answer", "reward"),
    [
        ([], "7", 1.0),  # answered without the tool, right
        ([], "3", 0.0),
        (["cf"], "7", 1.3),  # called with the right key, then right
        (["cx"], "3", 0.2),  # called, one letter right, then wrong
        (["ab"], "7", 1.1),
    ],
)
def test_the_quiz_rewards_the_answer_and_the_call(turns, answer, reward):
    quiz = module("quiz").Quiz()
    messages = quiz.reset({"key": "cf", "answer": "7"})
    for call in turns:
        messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": "?"}]
    messages.append({"role": "assistant", "content": answer})
    new, got, done = quiz.step(messages, answer)
    assert new == [] and done and got == pytest.approx(reward)


def test_the_script_rebuilds_the_shipped_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_toy_tools_data.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in ("train.jsonl", "eval.jsonl", "tokenizer/tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (TOY / name).read_bytes(), name
