"""The optimizer's step on the learner's own sharded parameters: the learner's (local shards)
against torch's own on the DTensors, and fused against foreach.

    python benchmarks/bench_optimizer.py --config FILE [--set section.key=value ...]
        [--steps N] [--warmup N]
    torchrun --nproc-per-node N benchmarks/bench_optimizer.py --config FILE ...

`[optimizer] implementation = "auto"` means torch's fused Adam/AdamW kernels on CUDA and
`foreach` on a CPU, where the fused ones run too. The learner's Adam and AdamW step each
rank's local shards (titan_learner.learner.optim.local_shard_adam); TorchTitan's optimizers step
the DTensors through DTensor's dispatch. The learner is built from the config (its model
sharded as configured), then three optimizers step the same parameters with the same
gradients, taking turns (drift meets them alike): `torch foreach`, torch's own foreach step
on the DTensors (the baseline: what TorchTitan's container runs), and the learner's `foreach`
and `fused`. Printed: each one's median step time, `ratio foreach/torch foreach` and `ratio
fused/foreach`, and how far one step of each, from the same weights and an empty state, lands
from another (the largest parameter difference: 0 for the local shards, which are exact).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from result_file import add_result_argument, write_result
from torch.distributed.tensor import DTensor

from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.learner.optim.local_shard_adam import local_tensor, torch_step
from titan_learner.learner.optim.optimizer import build_optimizer
from titan_learner.learner.titan import TitanLearner

IMPLEMENTATIONS = ("foreach", "fused")
BASELINE = "torch foreach"


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor), detached."""
    return tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    add_result_argument(parser, "optimizer")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def one_step_gaps(learner: TitanLearner, steps: dict[str, Callable[[], None]]) -> dict:
    """The largest |parameter difference| after one step of each from the same weights:
    foreach against torch's, fused against foreach."""
    params = [p for p in learner.model.parameters() if p.grad is not None]
    start = [p.detach().clone() for p in params]

    @torch.no_grad()
    def restore() -> None:
        for p, s in zip(params, start, strict=True):
            p.copy_(s)

    after = {}
    for name, step in steps.items():
        restore()
        step()
        after[name] = [full(p) for p in params]
    restore()
    return {
        (a, b): max(float((x - y).abs().max()) for x, y in zip(after[a], after[b], strict=True))
        for a, b in (("foreach", BASELINE), ("fused", "foreach"))
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        learner = TitanLearner.from_config(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if learner.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does (see benchmarks/bench_step.py)
    generator = torch.Generator().manual_seed(config.run.seed + learner.data_parallel_rank)
    for p in learner.model.parameters():  # the same gradients for all three, every step
        p.grad = torch.zeros_like(p)
        local_tensor(p.grad).copy_(torch.randn(local_tensor(p).shape, generator=generator) * 1e-2)

    def build(implementation: str):
        optimizer = replace(config.optimizer, implementation=implementation)
        config_ = replace(config, optimizer=optimizer)
        return build_optimizer(learner.model, config_, learner.device.type)

    steps = {BASELINE: torch_step(build("foreach"))}
    steps.update((name, build(name).step) for name in IMPLEMENTATIONS)
    gaps = one_step_gaps(learner, steps)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.warmup + args.steps):
        for name, step in steps.items():
            if learner.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
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
            print(f"{name:<13} median {seconds * 1e3:9.2f} ms/step")
        for (a, b), gap in gaps.items():
            print(f"one step from the same weights, {a} against {b}: largest difference {gap:.1e}")
        print(f"ratio foreach/{BASELINE}: {medians['foreach'] / medians[BASELINE]:.2f}")
        print(f"ratio fused/foreach: {medians['fused'] / medians['foreach']:.2f}")
        write_result(
            args.result_json,
            benchmark="optimizer: fused vs foreach",
            metric="step time, fused / foreach",
            ratio=f"{medians['fused'] / medians['foreach']:.2f} ({params / 1e6:.2f} M)",
            details={"ms_per_step": {k: v * 1e3 for k, v in medians.items()}, "params": params},
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
