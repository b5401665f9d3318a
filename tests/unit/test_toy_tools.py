"""The multi-turn default's files (configs/toy_tools): a character tokenizer with a chat
template, questions whose answers only the tool knows (sensor readings that change with every
call), the tool-call parser and the environment's reward; scripts/make_toy_tools_data.py
rebuilds them byte for byte."""

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
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "c"},
        {"role": "tool", "content": "7"},
    ]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><user>c<sep><assistant>c<eos><tool>7<sep><assistant>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 11 and tokenizer.decode(ids) == text


def test_every_sensor_is_asked_and_no_row_holds_its_reading():
    sensors = module("tools").SENSORS
    expected = [{"key": k, "answer": f"lookup({k})"} for k in sensors]
    assert sensors == "abcdefghij"
    assert rows("train.jsonl") == expected and rows("eval.jsonl") == expected


def test_a_reading_changes_from_call_to_call_and_only_sensors_are_read():
    lookup = module("tools").lookup
    readings = [lookup("c") for _ in range(200)]
    assert set(readings) == set("0123456789")
    again = module("tools").lookup  # a fresh process: the same seeded readings
    assert readings == [again("c") for _ in range(200)]
    with pytest.raises(ValueError, match="no sensor 'cf'; sensors: one letter from a to j"):
        lookup("cf")


def test_a_turn_of_one_letter_is_a_call():
    parse = module("parse").parse
    assert parse("c") == [{"name": "lookup", "arguments": {"key": "c"}}]
    assert parse("7") == [] and parse("cf") == [] and parse("k") == [] and parse("") == []


@pytest.mark.parametrize(
    ("turns", "answer", "reward"),
    [
        ([], "7", 0.0),  # no call: nothing, whatever the answer
        ([("c", "7")], "7", 1.0),  # the asked sensor, its reading
        ([("c", "7")], "3", 0.3),  # the asked sensor, another digit
        ([("a", "7")], "7", 0.3),  # another sensor's reading, read right
        ([("a", "4")], "7", 0.1),  # called, nothing else right
        ([("c", "7")], "", 0.3),  # no answer at all
        ([("a", "4"), ("c", "7")], "7", 1.0),  # the last call counts
        ([("c", "7"), ("a", "4")], "7", 0.1),
        ([("c", "error: x")], "e", 0.3),  # an error is no reading
    ],
)
def test_the_quiz_pays_the_reading_of_the_asked_sensor(turns, answer, reward):
    quiz = module("quiz").Quiz()
    messages = quiz.reset({"key": "c", "answer": "lookup(c)"})
    for call, reply in turns:
        messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": reply}]
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
