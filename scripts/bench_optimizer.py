"""The optimizer's step, fused against foreach, on the learner's own sharded parameters.

    python scripts/bench_optimizer.py --config FILE [--set section.key=value ...]
        [--steps N] [--warmup N]
    torchrun --nproc-per-node N scripts/bench_optimizer.py --config FILE ...

`[optimizer] implementation = "auto"` means torch's fused Adam/AdamW kernels on CUDA and
`foreach` on a CPU, where the fused ones run too. This measures what they would save there:
the learner is built from the config (its model sharded as configured), then two of its
optimizers, one `foreach` and one `fused`, step the same parameters with the same gradients,
taking turns (drift meets both alike). Printed: each one's median step time, `ratio fused/foreach`, and how far one step of each, from the same
weights and an empty state, lands apart (the largest parameter difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.learner.optimizer import build_optimizer
from titan_learner.learner.titan import TitanLearner

IMPLEMENTATIONS = ("foreach", "fused")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor), detached."""
    return tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def one_step_gap(learner: TitanLearner, optimizers: dict) -> float:
    """The largest |parameter difference| after one step of each from the same weights."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    start = [p.detach().clone() for p in params]

    @torch.no_grad()
    def restore() -> None:
        for p, s in zip(params, start, strict=True):
            p.copy_(s)

    after = {}
    for name, optimizer in optimizers.items():
        restore()
        optimizer.step()
        after[name] = [full(p) for p in params]
    restore()
    pairs = zip(*(after[name] for name in IMPLEMENTATIONS), strict=True)
    return max(float((a - b).abs().max()) for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        learner = TitanLearner.from_config(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if learner.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does (see scripts/bench_step.py)
    generator = torch.Generator().manual_seed(config.run.seed + learner.data_parallel_rank)
    for p in learner.model.parameters():  # the same gradients for both, for every step
        p.grad = torch.zeros_like(p)
        local(p.grad).copy_(torch.randn(local(p).shape, generator=generator) * 1e-2)
    optimizers = {
        name: build_optimizer(
            learner.model,
            replace(config, optimizer=replace(config.optimizer, implementation=name)),
            learner.device.type,
        )
        for name in IMPLEMENTATIONS
    }
    gap = one_step_gap(learner, optimizers)
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for round_ in range(args.warmup + args.steps):
        for name, optimizer in optimizers.items():
            if learner.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if learner.device.type == "cuda":
                torch.cuda.synchronize()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in learner.model.parameters())
        print(
            f"config: {config.source}  model: {config.model.name} ({params / 1e6:.2f} M params)  "
            f"device: {learner.device.type}  world: {learner.capabilities.world_size}; "
            f"{args.steps} timed after {args.warmup} warmup"
        )
        for name, seconds in medians.items():
            print(f"{name:<8} median {seconds * 1e3:9.2f} ms/step")
        print(f"one step from the same weights: largest parameter difference {gap:.1e}")
        print(f"ratio fused/foreach: {medians['fused'] / medians['foreach']:.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
