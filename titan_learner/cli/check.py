"""`titan-learner check`: validate a config and say what it will build, without building it.

Every check `validate` holds runs; what depends on the machine the run is meant for (a CUDA
device, flex attention, a local `hf_checkpoint`) is a warning here, since a cluster config is
often checked on a laptop. A vLLM run's vllm install is not: its later checks import vllm, so
`check` stops where `train` would, with the same line. The model is built on the meta device only (no memory), so checking
an 8B config takes seconds. Where the data and the tokenizer are on this machine, the prompts
are read as train reads them (every row tokenized: an overlong prompt, or none left).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_learner.config.schema import Config
from titan_learner.config.toml import config_to_toml
from titan_learner.job.validate import Validated, validate

GIB = 1024**3


@dataclass(frozen=True)
class Plan:
    """What a config resolves to on a given world size, and its memory per rank."""

    validated: Validated
    bytes_per_rank: dict[str, int]
    skipped_prompts: int | None = None  # None: the data or the tokenizer is not here
    engine_note: str | None = None  # a GPU engine's share where this machine has no GPU


def plan(config: Config, world_size: int) -> Plan:
    """Raises ConfigError, or DataError where train would (the same one line)."""
    validated = validate(config, world_size, on_this_machine=False)
    skipped = read_prompts(config)
    shards = validated.dp_shard * validated.tp
    master = 4 * validated.parameters // shards  # fp32 sharded parameters (FSDP's masters)
    trained = 4 * validated.trainable // shards  # with [model.lora], the adapters alone
    moments = 2 * trained  # Adam/AdamW exp_avg and exp_avg_sq
    memory = {"parameters": master, "gradients": trained, "optimizer": moments}
    frozen = frozen_copies(config)
    if frozen:
        memory["frozen"] = frozen * master
    engine, note = engine_memory(config, validated)
    if engine:
        memory["vllm"] = engine
    return Plan(validated, memory, skipped, engine_note=note)


def engine_memory(config: Config, v: Validated) -> tuple[int, str | None]:
    """Each rank's colocated vLLM engine (none with servers or the embedded generator): on CPU
    its weights and the KV cache the job gives it; on a GPU, its gpu_memory_utilization of the
    rank's GPU (counted where this machine has one, else said)."""
    engine = config.rollout.vllm
    if config.rollout.generator != "vllm" or engine.get("servers"):
        return 0, None
    if v.device_type == "cpu":
        from titan_learner.model.hf_config import learner_hf_config
        from titan_learner.vllm.checks import engine_rows
        from titan_learner.vllm.engine_memory import job_engine_memory

        rows = engine_rows(config, v.dp_replicate * v.dp_shard)
        memory = job_engine_memory(config, learner_hf_config(config), rows=rows)
        kv_cache = engine.get("kv_cache_memory_bytes", memory.kv_cache)
        return memory.weights + kv_cache, None
    import torch

    from titan_learner.vllm.engine_memory import GPU_ENGINE_SHARE

    share = engine.get("gpu_memory_utilization", GPU_ENGINE_SHARE)

    if torch.cuda.is_available():
        return int(share * torch.cuda.get_device_properties(0).total_memory), None
    return 0, f"vllm: {share} of each rank's GPU (gpu_memory_utilization), beside the above"


def read_prompts(config: Config) -> int | None:
    """Train's own reading of the prompts where they and the tokenizer are on this machine:
    how many overlong prompts it would skip; None where it cannot read them here. The rewards
    are not built (validate has checked them): a reward model's weights are not loaded."""
    from titan_learner.data.files import resolve
    from titan_learner.data.loader import load_prompts
    from titan_learner.data.tokenizer import load_tokenizer, tokenizer_dir

    base = Path(config.source).parent
    files = [resolve(name, base) for name in (*config.data.train_files, *config.data.eval_files)]
    if not tokenizer_dir(config).is_dir() or not all(path.is_file() for path in files):
        return None
    tokenizer = load_tokenizer(config)
    return sum(
        load_prompts(config, tokenizer, names).skipped
        for names in (config.data.train_files, config.data.eval_files)
        if names
    )


def frozen_copies(config: Config) -> int:
    """Parameter copies the job holds besides the policy, sharded like it: the KL reference
    (none with [model.lora]: the base itself), and the weights kept for stale steps' log-prob
    mismatch (k for k steps off-policy)."""
    from titan_learner.job.kl_reward import uses_reference

    reference = 1 if uses_reference(config) and config.model.lora is None else 0
    rollout = config.rollout
    kept = rollout.max_off_policy_steps if rollout.stale_logprob_mismatch else 0
    return reference + kept


def render(config: Config, p: Plan) -> str:
    v = p.validated
    lines = [f"config: {config.source} (valid)", "", "[resolved]", config_to_toml(config)]
    mesh = f"dp_replicate={v.dp_replicate} x dp_shard={v.dp_shard} x tp={v.tp}"
    total = sum(p.bytes_per_rank.values())
    lines += [
        "",
        f"world size: {v.world_size}   mesh: {mesh}",
        f"parameters: {v.parameters:,} ({_count(v.parameters)})",
        *(
            [
                f"trainable: {v.trainable:,} ({_count(v.trainable)}, the LoRA adapters); "
                f"frozen: {v.parameters - v.trainable:,} ({_count(v.parameters - v.trainable)})"
            ]
            if v.trainable != v.parameters
            else []
        ),
        "memory per rank (fp32 masters, gradients and Adam moments of the trainable ones, and "
        "any frozen copies: the KL reference, weights kept for stale steps; sharded over "
        "dp_shard x tp; activations excluded; vllm: a colocated engine's weights and KV cache):",
    ]
    lines += [f"  {k:<10} {_size(n):>12}" for k, n in p.bytes_per_rank.items()]
    lines.append(f"  {'total':<10} {_size(total):>12}")
    if p.engine_note:
        lines.append(f"  {p.engine_note}")
    if p.skipped_prompts:
        lines.append(f"prompts: {p.skipped_prompts} longer than max_prompt_tokens, to be skipped")
    lines += [f"warning: {warning}" for warning in v.warnings]
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.2f} MiB"


def _count(n: int) -> str:
    """A parameter count as people say it: 8.03 B, 1.72 B, 0.13 M (a toy's 0.00 B says nothing)."""
    return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"
