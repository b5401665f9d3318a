"""Token-budget micro-batches against one padded batch, on a realistic mix of lengths.

    python benchmarks/bench_microbatch.py [--config FILE] [--set section.key=value ...]
        [--rows N] [--budget TOKENS] [--steps N] [--warmup N]

The batch is what a GRPO rollout of a reasoning task looks like: prompts of 30-300 tokens
(uniform) and responses log-normal between 10 and 1,000 tokens (median ~120), left-padded to
the longest row. Two learners built from the same config (same initial weights) take the
same steps on the same batches:

- padded: `update(batch)` on the whole `[rows, longest]` batch (`max_tokens_per_microbatch = 0`);
- budget: the same call with `[learner] max_tokens_per_microbatch = --budget`, which sorts the
  rows by length, packs them into micro-batches of at most that many positions and trims each
  to its own longest row (titan_learner.learner.microbatch).

Printed: the fraction of computed positions that are padding in each, median seconds per
step, real (non-padding) tokens per second, and `ratio budget/padded` of tokens/s. The loss and
weights after the steps are compared too (they must agree: the split changes nothing else).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from result_file import add_result_argument, write_result
from tensordict import TensorDict

from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.learner.batch import ATTENTION_MASK_KEY, TOKENS_KEY, batch_from_parts
from titan_learner.learner.microbatch import token_budget_micro_batches
from titan_learner.learner.titan import TitanLearner

SHAPE = [
    "model.overrides.vocab_size=4096",
    "model.overrides.dim=128",
    "model.overrides.n_layers=2",
    "model.overrides.n_heads=4",
    "model.overrides.n_kv_heads=2",
    "model.overrides.hidden_dim=384",
    "model.overrides.max_seq_len=2048",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_config_arguments(parser)
    parser.add_argument("--rows", type=int, default=32, help="sequences per step")
    parser.add_argument("--budget", type=int, default=4096, help="max_tokens_per_microbatch")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    add_result_argument(parser, "microbatch")
    args = parser.parse_args(argv)
    if args.config is None:
        args.config = "configs/debug.toml"
    return args


def realistic_batch(rows: int, vocab: int, generator: torch.Generator) -> TensorDict:
    """Prompts 30-300 tokens, responses log-normal 10-1,000 tokens, left-padded."""
    prompts = torch.randint(30, 301, (rows,), generator=generator)
    normal = torch.randn(rows, generator=generator)
    responses = torch.exp(4.8 + 1.0 * normal).round().clamp(10, 1000).long()
    real = prompts + responses
    width = int(real.max())
    positions = torch.arange(width).expand(rows, width)
    attention = positions >= (width - real).unsqueeze(1)
    assistant = positions >= (width - responses).unsqueeze(1)
    tokens = torch.where(attention, torch.randint(0, vocab, (rows, width), generator=generator), 0)
    log_probs = -torch.rand(rows, width, generator=generator) * 3.0
    advantage = torch.randn(rows, 1, 1, generator=generator)
    return batch_from_parts(tokens, attention, assistant, log_probs, advantage)


def time_updates(learner: TitanLearner, batches: list[TensorDict], warmup: int) -> list[float]:
    times = []
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        learner.update(batch)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        overrides = [*SHAPE, *args.overrides]
        padded_config = load_config(args.config, overrides)
        budget_config = load_config(
            args.config, [*overrides, f"learner.max_tokens_per_microbatch={args.budget}"]
        )
        padded = TitanLearner.from_config(padded_config)
        budgeted = TitanLearner.from_config(budget_config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as bench_step: steadier CPU times on few cores
    generator = torch.Generator().manual_seed(padded_config.run.seed)
    batches = [
        realistic_batch(args.rows, padded.vocab_size, generator)
        for _ in range(args.warmup + args.steps)
    ]
    real = sum(int(b.get(ATTENTION_MASK_KEY).sum()) for b in batches[args.warmup :])
    padded_positions = sum(b.get(TOKENS_KEY).numel() for b in batches[args.warmup :])
    budget_positions = sum(
        m.get(TOKENS_KEY).numel()
        for b in batches[args.warmup :]
        for m in token_budget_micro_batches(b, args.budget, lambda count: count)
    )
    budget_times = time_updates(budgeted, batches, args.warmup)
    padded_times = time_updates(padded, batches, args.warmup)
    weights_a = padded.get_weights(dtype=torch.float32)
    weights_b = budgeted.get_weights(dtype=torch.float32)
    if dist.get_rank() == 0:
        gap = max(float((weights_a[k] - weights_b[k]).abs().max()) for k in weights_a.keys())
        per_step = real / args.steps
        t_padded, t_budget = statistics.median(padded_times), statistics.median(budget_times)
        print(
            f"{args.rows} rows per step, {per_step:,.0f} real tokens per step; budget "
            f"{args.budget} tokens; {args.steps} timed steps after {args.warmup}\n"
            f"padded  padding {1 - real / padded_positions:6.1%} of {padded_positions:,} "
            f"positions  median {t_padded:7.2f} s/step  {per_step / t_padded:9,.0f} tokens/s\n"
            f"budget  padding {1 - real / budget_positions:6.1%} of {budget_positions:,} "
            f"positions  median {t_budget:7.2f} s/step  {per_step / t_budget:9,.0f} tokens/s\n"
            f"max |weight difference| after the steps: {gap:.1e}\n"
            f"ratio budget/padded (tokens/s): {t_padded / t_budget:.2f}"
        )
        write_result(
            args.result_json,
            benchmark="token-budget micro-batches",
            metric="tokens/s, budget / padded",
            ratio=f"{t_padded / t_budget:.2f}",
            details={"s_per_step": {"padded": t_padded, "budget": t_budget}, "rows": args.rows},
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
