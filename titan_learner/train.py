"""`python -m titan_learner.train --config FILE [--set k=v ...]`, alone or under torchrun.

Until the GRPO job (rollouts, rewards, weight sync) lands, this runs the Learner on synthetic
GRPO batches and prints per-step metrics: it exercises the whole build (TOML -> TorchTitan model
-> sharding -> TorchRL loss and stepper) on any layout, and is the README's first command.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from titan_learner.schema import ConfigError

SHOWN = ("loss_objective", "loss_entropy", "grad_norm", "lr", "clip_fraction", "kl_approx")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m titan_learner.train")
    parser.add_argument("--config", required=True, help="TOML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    return parser.parse_args(argv)


def format_metrics(step: int, steps: int, metrics: dict[str, float], tokens_per_s: float) -> str:
    shown = "  ".join(f"{k}={metrics[k]:.5g}" for k in SHOWN if k in metrics)
    return f"step {step:>4}/{steps}  {shown}  tokens/s={tokens_per_s:,.0f}"


def run(config) -> list[dict[str, float]]:
    """Build the learner and run `run.steps` updates on synthetic batches; metrics per step."""
    import torch.distributed as dist

    from titan_learner.batch import synthetic_batch
    from titan_learner.learner import TitanLearner

    learner = TitanLearner.from_config(config)
    rank = dist.get_rank()
    caps = learner.capabilities
    if rank == 0:
        print(
            f"titan_learner: {config.model.name}/{config.model.flavor} on {caps.world_size} "
            f"process(es), {caps.device_type}, dp={caps.data_parallel_size} "
            f"tp={caps.tensor_parallel_size}; synthetic GRPO batches (the GRPO job is not built yet)",
            flush=True,
        )
    generator = torch.Generator().manual_seed(config.run.seed)
    global_batch = config.run.batch_size * caps.data_parallel_size
    history = []
    for step in range(1, config.run.steps + 1):
        batch = synthetic_batch(global_batch, config.run.seq_len, learner.vocab_size, generator)
        local = learner.local_batch(batch)
        start = time.perf_counter()
        metrics = {k: float(v) for k, v in learner.update(local).items()}
        elapsed = time.perf_counter() - start
        history.append(metrics)
        if rank == 0:
            tokens = global_batch * config.run.seq_len
            print(format_metrics(step, config.run.steps, metrics, tokens / elapsed), flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from titan_learner.config import load_config

    try:
        config = load_config(args.config, args.overrides)
        run(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
