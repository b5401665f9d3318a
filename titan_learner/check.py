"""`python -m titan_learner check`: validate a config and say what it will build, without building it.

The model is built on the meta device only (no memory), so checking an 8B config is instant.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_learner.config import Config, check_world_size, config_to_toml

GIB = 1024**3


@dataclass(frozen=True)
class Plan:
    """What a config resolves to on a given world size."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    parameters: int
    bytes_per_rank: dict[str, int]


def validate_model(config: Config) -> int:
    """Build the model on meta (checks shapes against tp); return its parameter count."""
    from titan_learner import model as titan_model
    from titan_learner import parallel

    spec = titan_model.model_spec(config.model, "sdpa", config.source)
    parallel.prepare_model_config(spec, config)
    model = titan_model.build_meta(spec, config.source)
    return sum(p.numel() for p in model.parameters())


def plan(config: Config, world_size: int) -> Plan:
    dp_replicate, dp_shard, tp = check_world_size(config, world_size)
    n = validate_model(config)
    shards = dp_shard * tp
    master = 4 * n // shards  # fp32 sharded parameters (FSDP keeps fp32 masters)
    moments = 2 * master  # Adam/AdamW exp_avg and exp_avg_sq
    return Plan(
        world_size=world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=tp,
        parameters=n,
        bytes_per_rank={"parameters": master, "gradients": master, "optimizer": moments},
    )


def render(config: Config, p: Plan) -> str:
    lines = [f"config: {config.source} (valid)", "", "[resolved]", config_to_toml(config)]
    mesh = f"dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp}"
    total = sum(p.bytes_per_rank.values())
    lines += [
        "",
        f"world size: {p.world_size}   mesh: {mesh}",
        f"parameters: {p.parameters:,} ({p.parameters / 1e9:.2f} B)",
        "memory per rank (fp32 masters, gradients and Adam moments, sharded over dp_shard x tp; "
        "activations excluded):",
    ]
    lines += [f"  {k:<10} {_size(v):>12}" for k, v in p.bytes_per_rank.items()]
    lines.append(f"  {'total':<10} {_size(total):>12}")
    from titan_learner.model import hf_checkpoint_problem

    problem = hf_checkpoint_problem(config.model.hf_checkpoint)
    if problem:
        lines.append(f"warning: [model] hf_checkpoint: {problem} on this machine")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.2f} MiB"
