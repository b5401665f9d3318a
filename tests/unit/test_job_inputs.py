"""Bad job input ends in one line and exit 2, before any model is built: missing or malformed
data files, missing keys, empty and overlong data, rewards that do not import, a tokenizer
without the chat template the config asks for. (Rewards that fail while running, and whole
runs on a user's model directory: tests/integration/test_real_runs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_dirs import make_tokenizer, write_gsm8k_jsonl
from titan_learner.cli import main
from titan_learner.config.toml import config_from_dict
from titan_learner.data.loader import PromptLoader, load_prompts, rank_slice
from titan_learner.data.tokenizer import load_tokenizer

TINY_MODEL = {
    "name": "llama3",
    "overrides": {
        "vocab_size": 320,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "hidden_dim": 128,
    },
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(directory)
    plain = tmp_path_factory.mktemp("plain")
    make_tokenizer(plain, chat_template=False)
    return directory, plain


def toml_value(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\\\", "\\\\\\\\").replace('"', '\\\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def write_config(tmp_path, tokenizer: str, **sections) -> str:
    tables = {
        "model": {"name": "llama3"},
        "tokenizer": {"path": tokenizer},
        "data": {"train_files": ["train.jsonl"], "prompt_key": "question"},
        "rollout": {"prompts_per_step": 4, "group_size": 2},
        "run": {"output_dir": str(tmp_path / "out")},
        **sections,
    }
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    lines.append("[model.overrides]")
    lines += [f"{k} = {v}" for k, v in TINY_MODEL["overrides"].items()]
    lines.append('[[reward]]\nfunction = "math"')
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def train(capsys, config: str) -> str:
    assert main(["train", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


def test_missing_data_file(tmp_path, capsys, tokenizer_dir):
    config = write_config(tmp_path, str(tokenizer_dir[0]))
    err = train(capsys, config)
    assert (
        err
        == f"error: {config}: [data] train_files: {tmp_path / 'train.jsonl'} not found; allowed: a local JSONL, JSON or Parquet file\n"
    )


def test_malformed_jsonl_names_its_line(tmp_path, capsys, tokenizer_dir):
    (tmp_path / "train.jsonl").write_text(
        '{"question": "a", "answer": "1"}\n\n{"question": "b", answer}\n'
    )
    err = train(capsys, write_config(tmp_path, str(tokenizer_dir[0])))
    assert f"{tmp_path / 'train.jsonl'}:3: not valid JSON" in err


def test_missing_key_lists_the_keys_present(tmp_path, capsys, tokenizer_dir):
    (tmp_path / "train.jsonl").write_text('{"question": "a", "solution": "1"}\n')
    err = train(capsys, write_config(tmp_path, str(tokenizer_dir[0])))
    assert (
        f"{tmp_path / 'train.jsonl'}:1: missing key 'answer'; the row has: question, solution"
        in err
    )


def test_empty_dataset(tmp_path, capsys, tokenizer_dir):
    (tmp_path / "train.jsonl").write_text("\n")
    err = train(capsys, write_config(tmp_path, str(tokenizer_dir[0])))
    assert f"{tmp_path / 'train.jsonl'} holds no rows" in err


def test_overlong_prompt_is_an_error_or_skipped(tmp_path, capsys, tokenizer_dir):
    write_gsm8k_jsonl(
        tmp_path / "train.jsonl", [("What is 2 + 3?" * 20, "5"), ("What is 1 + 1?", "2")]
    )
    config = write_config(
        tmp_path,
        str(tokenizer_dir[0]),
        data={"train_files": ["train.jsonl"], "prompt_key": "question", "max_prompt_tokens": 40},
    )
    err = train(capsys, config)
    assert (
        f"{tmp_path / 'train.jsonl'}:1: the prompt is " in err
        and "more than [data] max_prompt_tokens = 40" in err
    )
    skipping = config_from_dict(
        {
            "tokenizer": {"path": str(tokenizer_dir[0])},
            "data": {"prompt_key": "question", "max_prompt_tokens": 40, "overlong": "skip"},
        },
        source=str(tmp_path / "run.toml"),
    )
    loaded = load_prompts(skipping, load_tokenizer(skipping), ["train.jsonl"])
    assert loaded.skipped == 1 and [p.text for p in loaded.prompts] == ["What is 1 + 1?"]


def test_reward_import_error(tmp_path, capsys, tokenizer_dir):
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "mine.py").write_text("import no_such_thing\n")
    config = write_config(tmp_path, str(tokenizer_dir[0]))
    with open(config, "a") as file:
        file.write('[[reward]]\nfunction = "mine.py:score"\n')
    err = train(capsys, config)
    assert "[[reward]] #2 function: 'mine.py:score': running" in err
    assert "failed: ModuleNotFoundError: No module named 'no_such_thing'" in err


def test_a_required_chat_template_that_is_missing(tmp_path, capsys, tokenizer_dir):
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    err = train(capsys, write_config(tmp_path, str(tokenizer_dir[1])))
    assert (
        f"[tokenizer] chat_template: the tokenizer in {tokenizer_dir[1]} has no chat template"
        in err
    )


def test_check_warns_for_missing_local_paths_and_fails_for_bad_ones(
    tmp_path, capsys, tokenizer_dir
):
    config = write_config(tmp_path, str(tmp_path / "no_tokenizer"))
    assert main(["check", "--config", config]) == 0
    out = capsys.readouterr().out
    assert (
        f"warning: on this machine, [data] train_files: {tmp_path / 'train.jsonl'} not found" in out
    )
    assert (
        f"warning: on this machine, [tokenizer] path: tokenizer directory {tmp_path / 'no_tokenizer'} not found"
        in out
    )
    (tmp_path / "train.jsonl").write_text('{"question": "a"}\n')
    assert main(["check", "--config", config]) == 2
    assert "missing key 'answer'" in capsys.readouterr().err


def test_chat_template_rendering_and_eos_ids(tmp_path, tokenizer_dir):
    config = config_from_dict(
        {
            "tokenizer": {"path": str(tokenizer_dir[0])},
            "data": {"prompt_key": "question", "system_prompt": "Be brief."},
        },
        source=str(tmp_path / "run.toml"),
    )
    tokenizer = load_tokenizer(config)
    ids = tokenizer.encode({"question": "What is 2 + 3?"}, "row 1")
    text = tokenizer.tokenizer.decode(ids)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_ids[0] == tokenizer.tokenizer.eos_token_id


def test_every_prompt_of_an_epoch_once_and_resume_on_any_data_parallel_size():
    """Global positions: 3 steps of 4 prompts, then resume, equal an uninterrupted 6 steps; the
    ranks' slices partition each step for 1, 2 or 4 data-parallel ranks."""
    prompts = list(range(10))
    whole = PromptLoader(prompts, 4, seed=3)
    steps = [whole.next_step() for _ in range(6)]
    assert sorted(steps[0] + steps[1] + steps[2][:2]) == prompts  # epoch 0: each row once
    first = PromptLoader(prompts, 4, seed=3)
    for _ in range(3):
        first.next_step()
    resumed = PromptLoader(prompts, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_step() for _ in range(3)] == steps[3:]
    for ranks in (1, 2, 4):
        for step in steps:
            parts = [rank_slice(step, r, ranks) for r in range(ranks)]
            assert [x for part in parts for x in part] == step


def test_a_job_without_rewards_or_with_two_of_one_name(tmp_path, capsys, tokenizer_dir):
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    config = Path(write_config(tmp_path, str(tokenizer_dir[0])))
    text = config.read_text()
    config.write_text(text.replace('[[reward]]\nfunction = "math"\n', ""))
    assert "[[reward]]: no [[reward]] table; allowed: at least one" in train(capsys, config)
    config.write_text(text + '[[reward]]\nfunction = "math"\n')
    err = train(capsys, config)
    assert "[[reward]] #2 name: two rewards are named 'math' (#1 and #2)" in err
    config.write_text(text + '[[reward]]\nfunction = "regex"\n')
    assert "[[reward]] #2 pattern: regex needs a pattern" in train(capsys, config)


def test_the_first_rows_are_read_without_parsing_the_rest(tmp_path):
    from titan_learner.data.errors import DataError
    from titan_learner.data.files import read_rows

    path = tmp_path / "big.jsonl"
    lines = [f'{{"question": "q{i}", "answer": "{i}"}}' for i in range(10)]
    lines[7] = "{broken"
    path.write_text("\n".join(lines) + "\n")
    assert [r.values["answer"] for r in read_rows(path, limit=5)] == ["0", "1", "2", "3", "4"]
    with pytest.raises(DataError, match=rf"{path}:8: not valid JSON"):
        read_rows(path)
