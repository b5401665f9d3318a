"""The KL reference's forward with shared prompts against scoring every token of every row.

    python benchmarks/bench_reference.py --config FILE [--set section.key=value ...]
        [--groups N] [--group-size G] [--steps N] [--warmup N]

With `[loss] kl_to_ref_coeff` the job scores every micro-batch under the frozen reference model
(titan_learner.job.reference) before the update. Two references from the same config (same
weights) score the same rollout-shaped batches (N groups of G rows sharing a prompt, each
response its own length, `[run] seq_len` positions):

- shared: `kl_log_probs(batch)`, what the job calls: the positions the KL reads (the response,
  under "rlhf" masking), with `[learner] share_prompts = true` (each prompt once per group);
- unshared: `log_probs(batch)` with `share_prompts = false`: every real token of every row,
  what the reference scored before it shared prompts.

Printed: median milliseconds per batch of each, the largest difference on the response
positions (they must agree), and `ratio shared/unshared`. One process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from result_file import add_result_argument, write_result

from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    grouped_synthetic_batch,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_config_arguments(parser)
    parser.add_argument("--groups", type=int, default=64, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=16, help="completions per prompt")
    parser.add_argument("--steps", type=int, default=20, help="timed batches per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    add_result_argument(parser, "reference")
    args = parser.parse_args(argv)
    if min(args.groups, args.group_size, args.steps) < 1 or args.warmup < 0:
        parser.error("--groups, --group-size and --steps must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kl = "loss.kl_to_ref_coeff=0.1"
    try:
        shared_config = load_config(
            args.config, [*args.overrides, kl, "learner.share_prompts=true"]
        )
        unshared_config = load_config(
            args.config, [*args.overrides, kl, "learner.share_prompts=false"]
        )
        shared, unshared = ReferenceModel(shared_config), ReferenceModel(unshared_config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    vocab = shared.model.config.vocab_size
    generator = torch.Generator().manual_seed(shared_config.run.seed)
    batch = grouped_synthetic_batch(
        args.groups, args.group_size, shared_config.run.seq_len, vocab, generator
    ).to(shared.device)
    variants = {
        "shared": lambda: shared.kl_log_probs(batch),
        "unshared": lambda: unshared.log_probs(batch),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.warmup + args.steps):
        for name, score in variants.items():  # taking turns: drift meets both alike
            start = time.perf_counter()
            score()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
    response = batch.get(ASSISTANT_MASK_KEY) & batch.get(ATTENTION_MASK_KEY)
    gap = float((variants["shared"]() - variants["unshared"]())[response].abs().max())
    medians = {name: statistics.median(values) for name, values in times.items()}
    rows = args.groups * args.group_size
    print(
        f"config: {shared_config.source}  batch: {args.groups} prompts x {args.group_size} "
        f"completions = {rows} rows of {shared_config.run.seq_len} positions; "
        f"{args.steps} timed after {args.warmup} warmup"
    )
    for name, seconds in medians.items():
        print(f"{name:<9} median {seconds * 1e3:9.1f} ms/batch")
    print(f"largest |shared - unshared| on the response: {gap:.1e}")
    print(f"ratio shared/unshared: {medians['shared'] / medians['unshared']:.2f}")
    write_result(
        args.result_json,
        benchmark="the KL reference on shared prompts",
        metric=f"time per batch of {args.groups} groups x {args.group_size}, shared / unshared",
        ratio=f"{medians['shared'] / medians['unshared']:.2f}",
        details={"ms_per_batch": {k: v * 1e3 for k, v in medians.items()}, "gap": gap},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
