"""`check` never approves what `train` rejects: one table of bad configs through both commands,
the same exit code (2) and the same one line. (What depends on the machine, a CUDA device or a
local path, is a warning in `check` by design: a cluster config is often checked elsewhere.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_learner.cli import main

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"

BAD = {
    "unknown key": (["parallelism.tpp=2"], "[parallelism]: unknown key 'tpp' (did you mean 'tp'?)"),
    "loss keyword": (["loss.clip_eps=0.2"], "[loss]: unknown key 'clip_eps' for loss 'grpo'"),
    "aggregation with a hyphen": (
        ['loss.aggregation="token-mean"'],
        "[loss] aggregation: 'token-mean' is verl's name; here it is 'token_mean'; allowed: "
        "'token_mean', 'prompt_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm'",
    ),
    "verl's aggregation name": (
        ['loss.aggregation="seq-mean-token-mean"'],
        "[loss] aggregation: 'seq-mean-token-mean' is verl's name; here it is 'prompt_mean'; "
        "allowed: 'token_mean', 'prompt_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm'\n",
    ),
    "per-token aggregation": (
        ['loss.aggregation="none"'],
        "[loss] aggregation: 'none' is not allowed; allowed: 'token_mean', 'prompt_mean', "
        "'seq_mean_token_sum', 'seq_mean_token_sum_norm'; TorchRL's 'none' leaves a loss per "
        "token, not the scalar the learner trains",
    ),
    "summed reduction": (
        ['loss.reduction="sum"'],
        "[loss] reduction: 'sum' is not allowed; allowed: 'mean'; TorchRL's GRPO-family losses "
        "ignore 'sum' and take means",
    ),
    "masking strategy typo": (
        ['loss.masking_strategy="rlfh"'],
        "[loss] masking_strategy: 'rlfh' is not allowed; allowed: 'sft', 'rlhf', 'generic' "
        "(did you mean 'rlhf'?)",
    ),
    "clip_epsilon low of 1": (
        ["loss.clip_epsilon=[1.0, 0.28]"],
        "[loss] clip_epsilon: [1.0, 0.28] is out of range; allowed: 0 < clip_epsilon < 1, or "
        "[low, high] with 0 <= low < 1 and high > 0 (finite numbers)",
    ),
    "negative entropy coefficient": (
        ["loss.entropy_coeff=-0.01"],
        "[loss] entropy_coeff: -0.01 is out of range; allowed: >= 0",
    ),
    "KL coefficient nan": (
        ["loss.kl_to_ref_coeff=nan"],
        "[loss] kl_to_ref_coeff: nan is not a finite number; allowed: a finite number",
    ),
    "entropy bonus not a boolean": (
        ['loss.entropy_bonus="yes"'],
        "[loss] entropy_bonus: expected true or false, got 'yes'",
    ),
    "unread gamma": (
        ["loss.gamma=0.99"],
        "[loss] gamma: TorchRL's GRPO-family losses take gamma but never read it; allowed: "
        "leave it out",
    ),
    "lr nan": (["optimizer.lr=nan"], "[optimizer] lr: nan is not a finite number"),
    "group of one": (["rollout.group_size=1"], "[rollout] group_size: 1 is out of range"),
    "no prompts": (["data.train_files=[]"], "[data] train_files: none given"),
    "vocabulary too small": (
        ["model.overrides.vocab_size=12"],
        "the tokenizer has 14 tokens but the model's vocab_size is 12",
    ),
    "sequence too long": (
        ["model.overrides.max_seq_len=20"],
        "[data] max_prompt_tokens: max_prompt_tokens + max_new_tokens = 16 + 8 = 24 positions",
    ),
    "heads and tp": (
        ["parallelism.tp=3", "parallelism.dp_shard=1", "--world-size=3"],
        "[parallelism] tp: tp = 3 must divide n_heads (4)",
    ),
    "prompts per rank": (
        ["rollout.prompts_per_step=3", "parallelism.dp_shard=2", "--world-size=2"],
        "[rollout] prompts_per_step: 3 prompts do not split over 2 data-parallel ranks",
    ),
    "vllm weights from no directory": (
        ['rollout.generator="vllm"', 'rollout.vllm.load_format="safetensors"'],
        "[rollout.vllm] load_format: load_format = 'safetensors' reads weights from a model "
        "directory, and this run has none (its model is built from [model] flavor); allowed: "
        "leave load_format out (the engines start from vLLM's dummy weights, which the first "
        "push replaces), or name a directory in [rollout] model_path or [model] hf_checkpoint",
    ),
    "vllm greedy groups": (
        ['rollout.generator="vllm"', 'rollout.model_path="engine"', "rollout.temperature=0.0"],
        "[rollout] temperature: temperature 0 is greedy decoding, which vLLM allows only for one "
        "completion per prompt, got 16",
    ),
    "vllm hot eval": (
        ['rollout.generator="vllm"', 'rollout.model_path="engine"', "eval.temperature=3.0"],
        "[eval] temperature: temperature 3.0 is above vLLM's limit; allowed: 0 < temperature <= 2",
    ),
    "vllm seed twice": (
        ['rollout.generator="vllm"', 'rollout.model_path="engine"', "rollout.vllm.seed=3"],
        "[rollout.vllm] seed: seed is set by [run] seed, not here",
    ),
    "vllm weight transfer typo": (
        [
            'rollout.generator="vllm"',
            'rollout.model_path="engine"',
            'rollout.vllm.weight_transfer="NCCL"',
        ],
        "[rollout.vllm] weight_transfer: 'NCCL' is not a weight-transfer backend; allowed: auto, "
        "ipc, nccl, nccl_m2n, gloo",
    ),
    "nccl_m2n from a rollout thread": (
        [
            'rollout.generator="vllm"',
            'rollout.model_path="engine"',
            'rollout.vllm.weight_transfer="nccl_m2n"',
            "rollout.max_off_policy_steps=1",
        ],
        "[rollout.vllm] weight_transfer: 'nccl_m2n' runs every trainer rank in each update, in "
        "step with training, and max_off_policy_steps = 1 samples ahead in a rollout thread; "
        "allowed: max_off_policy_steps = 0, or weight_transfer nccl or gloo",
    ),
    "nccl_m2n with lora": (
        [
            'rollout.generator="vllm"',
            'rollout.model_path="engine"',
            'rollout.vllm.weight_transfer="nccl_m2n"',
            "model.lora.rank=8",
        ],
        "[rollout.vllm] weight_transfer: 'nccl_m2n' sends each trainer rank's own shards without "
        "gathering them, and [model.lora] pushes merged weights (W + alpha/rank B A), which need "
        "the whole adapters; allowed: weight_transfer nccl, gloo or auto with [model.lora]",
    ),
    "lora target that matches nothing": (
        ['model.lora.target_modules=["wq", "wo"]'],
        "[model.lora] target_modules: 'wq' matches no Linear of the llama3 model; allowed: one or "
        "more of lm_head, w1, w2, w3, wo, wqkv (q, k and v are one fused Linear, wqkv)",
    ),
    "token budget shorter than a sequence": (
        ["learner.max_tokens_per_microbatch=20"],
        "[learner] max_tokens_per_microbatch: max_tokens_per_microbatch = 20 is shorter than the "
        "longest training sequence (max_prompt_tokens + max_new_tokens = 24); allowed: at least 24",
    ),
    "token budget with accumulation": (
        ["learner.max_tokens_per_microbatch=4096", "learner.grad_accum_steps=2"],
        "[learner] max_tokens_per_microbatch: max_tokens_per_microbatch = 4096 splits each step "
        "by tokens and grad_accum_steps = 2 by count",
    ),
    "compile, tp and ac": (
        ["compile.enable=true", "parallelism.tp=2", "activation_checkpoint.mode=full"],
        "[compile] enable: compile with tensor parallel and activation checkpointing together",
    ),
}


def command(name: str, overrides: list[str]) -> list[str]:
    sets = [a for o in overrides if not o.startswith("--") for a in ("--set", o)]
    return [name, "--config", str(TOY), *sets]


@pytest.mark.parametrize("case", list(BAD))
def test_train_and_check_reject_alike(case, capsys, monkeypatch, tmp_path):
    overrides, message = BAD[case]
    world = next((o.split("=")[1] for o in overrides if o.startswith("--world-size")), "1")
    monkeypatch.setenv("WORLD_SIZE", world)  # what torchrun sets; check reads it too
    outputs = {}
    for name in ("train", "check"):
        extra = ["--set", f'run.output_dir="{tmp_path / name}"']
        assert main([*command(name, overrides), *extra]) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, (name, captured)
        outputs[name] = captured.err
    assert outputs["train"] == outputs["check"]
    assert outputs["train"].startswith(f"error: {TOY}: ") and message in outputs["train"]


DATA = {  # every row is read and tokenized: the first rows alone would pass
    "an overlong prompt": (
        ["data.max_prompt_tokens=7"],
        "tokens, more than [data] max_prompt_tokens = 7; allowed: raise it, or overlong = "
        '"skip" to leave such prompts out',
    ),
    "no prompts left": (
        ["data.max_prompt_tokens=2", 'data.overlong="skip"'],
        "are longer than max_prompt_tokens = 2",
    ),
}


@pytest.mark.parametrize("case", list(DATA))
def test_train_and_check_read_the_prompts_alike(case, capsys, monkeypatch, tmp_path):
    overrides, message = DATA[case]
    monkeypatch.setenv("WORLD_SIZE", "1")
    outputs = {}
    for name in ("train", "check"):
        extra = ["--set", f'run.output_dir="{tmp_path / name}"']
        assert main([*command(name, overrides), *extra]) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, (name, captured)
        outputs[name] = captured.err
    assert outputs["train"] == outputs["check"]
    assert message in outputs["train"], outputs["train"]
    assert f"{TOY.parent / 'toy' / 'sort_train.jsonl'}" in outputs["train"]  # names the file


def test_check_says_how_many_prompts_train_would_skip(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(command("check", ["data.max_prompt_tokens=7", 'data.overlong="skip"'])) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("prompts: ")]
    count = int(line.split()[1])
    assert count > 0 and line == f"prompts: {count} longer than max_prompt_tokens, to be skipped"
