"""Step time of the learner against a bare TorchTitan training step on the same sharded model.

    python benchmarks/bench_step.py --config FILE [--set section.key=value ...] [--steps N] [--warmup N]
        [--group-size G]
    torchrun --nproc-per-node N benchmarks/bench_step.py --config FILE ...

`--group-size G` makes the batches rollout-shaped (groups of G rows sharing a prompt, each
response its own length); with `--set learner.share_prompts=true` the learner's phases run each
prompt once, while the baseline trains on the same padded rows as TorchTitan's trainer would.

What is measured, per optimizer step (`[learner] grad_accum_steps` micro-batches of
`[run] batch_size` x `[run] seq_len` synthetic GRPO sequences per rank):

- learner: `TitanLearner.update(batch)` for each micro-batch, i.e. everything a GRPO job pays:
  the batch check, the policy's left-justified forward and log-probs (chunked by default), the
  TorchRL loss, backward, clipping, the optimizer and LR-scheduler step and the metrics.
- baseline: what TorchTitan's own trainer (`Trainer.train_step`) does for pretraining on the
  very same sharded model, optimizer and tokens: count the step's valid tokens (summed over
  data-parallel ranks), forward, next-token cross-entropy summed and divided by that count
  (vocab-parallel under TP), backward, gradient clipping when `[learner] clip_norm` is set,
  `optimizer.step()`, the LR scheduler's step and `zero_grad()`. Its loss logging (every
  `log_freq` steps) is left out.
  Micro-batches accumulate as in TorchTitan's trainer, which reduces gradients on each of them;
  the learner defers that reduction to the last one, so with `grad_accum_steps` > 1 and
  several data-parallel ranks the learner may beat the baseline on communication.

- loss module: between the two, TorchRL's loss module called directly on the learner's policy
  (its forward, backward, then the same clipping, optimizer and scheduler steps as the
  baseline), without what `update()` adds around it: the batch check, the step's token-mean
  normalization, the non-finite agreement, the metrics and the stepper. `learner / loss module`
  is the learner's own bookkeeping.

- policy: between the loss module and the baseline, the same GRPO objective written by hand
  on the learner's policy (its chunked log-probs and entropy, the clipped ratio against the
  batch's log-probs, the token mean, the entropy bonus; the loss module's clip bounds and
  coefficient), then the same optimizer step. `loss module / policy` is TorchRL's loss
  machinery (TensorDict plumbing, masks, diagnostics); `policy / baseline` is the GRPO math
  and the policy's layout over a cross-entropy step.

Why the baseline is the reference: it is the step TorchTitan itself takes with the same model,
layout, dtype, activation checkpointing and compile settings, so `learner / baseline` isolates what
the learner adds on top of TorchTitan (policy, loss, checks, metrics). A ratio near 1 means the
learner is as fast as the sharded model allows; a large one points at the learner, not at
the parallelism config.

The phases take turns, one optimizer step each, so that drift of the machine (other
processes, clocks) meets them alike. Times are per-step medians of the slowest rank (CUDA
synchronized around each step); tokens/s counts padded tokens (B x T) over all data-parallel
ranks. Peak memory is torch.cuda.max_memory_allocated over each phase's steps (max over ranks)
on CUDA, and the process's peak RSS on CPU (one number for the process, the same for all).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from result_file import add_result_argument, default_path, write_result
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.dtypes import DTYPES
from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
    grouped_synthetic_batch,
    synthetic_batch,
)
from titan_learner.learner.loss.normalization import step_counts
from titan_learner.learner.optim.local_shard_adam import torch_step
from titan_learner.learner.titan import TitanLearner
from titan_learner.model.spec import uses_flex_attention

IGNORE_INDEX = -100
OBJECTIVE_TOLERANCE = 1e-4  # |hand-written GRPO objective - the loss module's loss|
SPLIT = {  # what the ratio of two consecutive phases measures
    ("learner", "loss module"): "the learner's bookkeeping",
    ("loss module", "policy"): "TorchRL's loss machinery",
    ("policy", "baseline"): "GRPO on the policy over a cross-entropy step",
    ("loss module", "baseline"): "TorchRL's loss on the policy over a cross-entropy step",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per phase")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="G > 1: rollout-shaped batches, groups of G rows sharing a prompt (for "
        "[learner] share_prompts); 1: independent rows",
    )
    add_result_argument(parser, "step")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.group_size < 1:
        parser.error("--steps must be >= 1, --warmup >= 0 and --group-size >= 1")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    phases: dict[str, Callable[[], None]], steps: int, warmup: int, device: torch.device
) -> dict[str, tuple[list[float], float]]:
    """Per phase: seconds per step and peak memory bytes, the phases taking turns step by step.

    Taking turns, every phase meets the same machine: on shared or throttled cores a phase
    timed after another would see other conditions (on 2 cores the dp_shard=2 ratio moved
    1.16-1.43 run to run when the phases ran one after the other). `warmup` untimed rounds
    first (the first steps compile).
    """
    for _ in range(warmup):
        for step in phases.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in phases}
    peaks = dict.fromkeys(phases, 0.0)
    for _ in range(steps):
        for name, step in phases.items():
            reset_peak_memory(device)
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], peak_memory_bytes(device))
    return {name: (times[name], peaks[name]) for name in phases}


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Elementwise max over ranks: a step is as slow as its slowest rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux


def learner_step(learner: TitanLearner, window: list[TensorDict]) -> Callable[[], None]:
    """One optimizer step of the learner: update() on each micro-batch of the window."""

    counts = step_counts(window)  # the step's mean over all its tokens, as the job takes it

    def step() -> None:
        for batch in window:
            learner.update(batch, step_counts=counts)

    return step


def autocast_of(learner: TitanLearner) -> torch.autocast:
    """The learner's autocast ([learner] mixed_precision), for the phases that call the model."""
    config = learner.config.learner
    return torch.autocast(
        learner.device.type, dtype=DTYPES[config.autocast_dtype], enabled=config.mixed_precision
    )


def optimizer_step(learner: TitanLearner) -> Callable[[], None]:
    """What closes every phase's step but the learner's, as TorchTitan's trainer does it:
    torch's clipping (when `[learner] clip_norm` is set), torch's own optimizer step on the
    DTensors (the learner's optimizers step the local shards, same state), the LR scheduler's
    step, `zero_grad()`."""
    optimizer, clip_norm = learner.optimizer, learner.config.learner.clip_norm
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer_step = torch_step(optimizer)

    def step() -> None:
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        optimizer_step()
        learner.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def baseline_step(learner: TitanLearner, window: list[TensorDict]) -> Callable[[], None]:
    """One TorchTitan-style pretraining step on the learner's own model and optimizer."""
    model, group = learner.model, learner.data_parallel_group
    autocast, close = autocast_of(learner), optimizer_step(learner)
    inputs = []
    for batch in window:  # labels once, outside the timed region, like a data loader would
        tokens = batch.get(TOKENS_KEY)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:, :-1] = torch.where(
            batch.get(ATTENTION_MASK_KEY)[:, 1:], tokens[:, 1:], IGNORE_INDEX
        )
        inputs.append((tokens, labels))
    flex = uses_flex_attention(model)
    model.train()

    def step() -> None:
        valid = sum((labels != IGNORE_INDEX).sum() for _, labels in inputs)
        if group is not None:
            dist.all_reduce(valid, group=group)
        for tokens, labels in inputs:
            masks = None
            if flex:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
                masks = model.get_attention_masks(positions.expand_as(tokens))
            with autocast:
                logits = model(tokens, attention_masks=masks)
            # Vocab-sharded DTensor logits under TP: the vocab-parallel loss, as TorchTitan does.
            parallel = loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()
            with parallel:
                loss = F.cross_entropy(
                    logits.flatten(0, 1).float(),
                    labels.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                (loss / valid).backward()
        close()

    return step


def loss_module_step(learner: TitanLearner, window: list[TensorDict]) -> Callable[[], None]:
    """One optimizer step through the learner's TorchRL loss module, called directly."""
    loss_module = learner.loss_module
    autocast, close = autocast_of(learner), optimizer_step(learner)
    needs_ref = bool(getattr(loss_module, "kl_to_ref_coeff", None))
    checked = [check_batch(batch, learner.vocab_size, needs_ref) for batch in window]

    def step() -> None:
        for batch in checked:
            with autocast:
                loss = summed_loss(loss_module(batch))
            (loss / len(checked)).backward()
        close()

    return step


def policy_step(learner: TitanLearner, window: list[TensorDict]) -> Callable[[], None]:
    """One optimizer step of a hand-written clipped GRPO objective on the learner's policy
    (GRPO's objective whatever `[loss] name` is; the loss module's clip bounds)."""
    autocast, close = autocast_of(learner), optimizer_step(learner)
    checked = [check_batch(batch, learner.vocab_size, False) for batch in window]

    def step() -> None:
        for batch in checked:
            with autocast:
                loss = grpo_objective(learner, batch)
            (loss / len(checked)).backward()
        close()

    return step


def grpo_objective(learner: TitanLearner, batch: TensorDict) -> torch.Tensor:
    """GRPO's clipped surrogate and entropy bonus as token means, written by hand on the
    learner's policy: what TorchRL's GRPOLoss computes, without its machinery."""
    loss_module = learner.loss_module
    low, high = loss_module._clip_bounds  # log-ratio bounds
    bonus = getattr(loss_module, "entropy_bonus", True)
    entropy_coeff = float(getattr(loss_module, "entropy_coeff", 0.0) or 0.0) if bonus else 0.0
    tokens, behaviour = batch.get(TOKENS_KEY), batch.get(LOG_PROBS_KEY)
    trained = batch.get(ASSISTANT_MASK_KEY) & torch.isfinite(behaviour)
    advantage = batch.get(ADVANTAGE_KEY).reshape(tokens.shape[0], -1)  # [B, 1] or [B, T]
    dist = learner.policy.token_dist(tokens, batch.get(ATTENTION_MASK_KEY), trained)
    log_ratio = torch.where(trained, dist.log_prob(tokens) - behaviour, 0.0)
    gain = torch.minimum(log_ratio.exp() * advantage, log_ratio.clamp(low, high).exp() * advantage)
    count = trained.sum().clamp_min(1)
    loss = -(torch.where(trained, gain, 0.0).sum() / count)
    if not entropy_coeff:
        return loss
    return loss - entropy_coeff * dist.entropy().sum() / count


def objective_gap(learner: TitanLearner, window: list[TensorDict]) -> float:
    """|hand-written objective - the loss module's loss| on the first batch, untimed: the
    policy phase must compute what the loss module does, or its ratio means nothing."""
    batch = check_batch(window[0], learner.vocab_size, False)
    with torch.no_grad(), autocast_of(learner):
        module = summed_loss(learner.loss_module(batch.clone()))
        return float((grpo_objective(learner, batch) - module).abs())


def summed_loss(out: TensorDict) -> torch.Tensor:
    """What a loss module's output trains: the sum of its `loss*` terms."""
    return sum(out.get(key) for key in out.keys() if key.startswith("loss"))


def measure(
    phases: dict[str, Callable[[], None]], args: argparse.Namespace, device: torch.device
) -> dict[str, tuple[float, float]]:
    """Per phase: (median seconds per step, peak memory bytes), both the max over ranks."""
    out = {}
    for name, (times, peak) in time_interleaved(phases, args.steps, args.warmup, device).items():
        *times, peak = max_over_ranks([*times, peak], device)
        out[name] = (statistics.median(times), peak)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The phases step the one LR schedule on every optimizer step, as a run does: it must last
    # for all of them (TorchTitan's schedule refuses to step past its end).
    schedule = f"run.steps={4 * (args.warmup + args.steps)}"
    try:
        config = load_config(args.config, [*args.overrides, schedule])
        learner = TitanLearner.from_config(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device, caps = learner.device, learner.capabilities
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: several OpenMP threads per process make small-model CPU step times
        # swing by 10x or more on few cores, which would drown the learner/baseline difference.
        torch.set_num_threads(1)
    run, accum = config.run, config.learner.grad_accum_steps

    # Ranks of one TP group must see the same batch; data-parallel ranks see different ones.
    generator = torch.Generator().manual_seed(run.seed + learner.data_parallel_rank)
    if run.batch_size % args.group_size:
        print(
            f"error: --group-size {args.group_size} does not divide [run] batch_size",
            file=sys.stderr,
        )
        return 2
    window = [
        rollout_shaped(
            run.batch_size, run.seq_len, learner.vocab_size, args.group_size, generator
        ).to(device)
        for _ in range(accum)
    ]

    phases = {
        "learner": learner_step(learner, window),
        "loss module": loss_module_step(learner, window),
    }
    gap = objective_gap(learner, window)
    if gap <= OBJECTIVE_TOLERANCE:
        phases["policy"] = policy_step(learner, window)
    elif dist.get_rank() == 0:
        print(
            f"note: no policy phase: the hand-written GRPO objective differs from the loss "
            f"module's loss by {gap:.2e} (> {OBJECTIVE_TOLERANCE}), so [loss] is not GRPO's",
            file=sys.stderr,
        )
    phases["baseline"] = baseline_step(learner, window)
    measured = measure(phases, args, device)
    skipped = int(getattr(learner.stepper, "skipped_nonfinite_steps", 0))

    if dist.get_rank() == 0:
        tokens = accum * run.batch_size * run.seq_len * caps.data_parallel_size
        params = sum(p.numel() for p in learner.model.parameters())
        memory = "max_memory_allocated" if device.type == "cuda" else "peak RSS so far"
        times = {name: seconds for name, (seconds, _) in measured.items()}
        lines = [
            f"config: {config.source}  model: {config.model.name} {config.model.flavor} "
            f"({_count(params)} params)  device: {device.type}  world: {caps.world_size} "
            f"(dp={caps.data_parallel_size} x tp={caps.tensor_parallel_size})",
            f"step = {accum} micro-batch(es) of {run.batch_size} x {run.seq_len} tokens per rank, "
            f"{tokens:,} tokens in all; {args.steps} timed after {args.warmup} warmup"
            + (
                f"; groups of {args.group_size} rows sharing a prompt"
                if args.group_size > 1
                else ""
            )
            + ("; the learner shares prompts" if config.learner.share_prompts else ""),
            *(
                f"{name:<11} median {seconds * 1e3:10.1f} ms/step  "
                f"{tokens / seconds:12,.0f} tokens/s  peak mem {_gib(peak)}"
                for name, (seconds, peak) in measured.items()
            ),
            f"ratio learner/baseline: {times['learner'] / times['baseline']:.2f}  "
            f"(peak mem: {memory}, max over ranks)",
            "of which: "
            + ", ".join(
                f"{upper}/{lower} {times[upper] / times[lower]:.2f} ({SPLIT[upper, lower]})"
                for upper, lower in itertools.pairwise(times)
            ),
        ]
        print("\n".join(lines))
        write_step_result(args, config, times, params, caps)
        if skipped:
            print(f"warning: the learner skipped {skipped} non-finite step(s)", file=sys.stderr)
    dist.destroy_process_group()
    return 0


def write_step_result(args, config, times: dict[str, float], params: int, caps) -> None:
    """The run's row of docs/performance.md's table: the shared-prompts row when the learner
    shares prompts, else the step's."""
    ratio = f"{times['learner'] / times['baseline']:.2f}"
    details = {"ms_per_step": {k: v * 1e3 for k, v in times.items()}, "params": params}
    details |= {"world_size": caps.world_size, "tensor_parallel": caps.tensor_parallel_size}
    if config.learner.share_prompts:
        path = args.result_json
        if path == default_path("step"):
            path = default_path("shared_prompts")
        write_result(
            path,
            benchmark="shared prompts (`[learner] share_prompts`)",
            metric=f"step time on {config.run.batch_size // args.group_size} groups x "
            f"{args.group_size}, learner / TorchTitan step on unshared rows",
            ratio=ratio,
            details=details,
        )
        return
    write_result(
        args.result_json,
        benchmark="learner step vs a bare TorchTitan step",
        metric="step time, learner / baseline",
        ratio=f"{ratio} ({params / 1e6:.2f} M params, {caps.world_size} process(es))",
        details=details,
    )


def rollout_shaped(
    rows: int, seq_len: int, vocab_size: int, group_size: int, generator: torch.Generator
) -> TensorDict:
    """One micro-batch: independent rows (group_size 1), or groups of `group_size` rows that
    share a prompt, each with its own response length, as a rollout gives them."""
    if group_size == 1:
        return synthetic_batch(rows, seq_len, vocab_size, generator)
    return grouped_synthetic_batch(rows // group_size, group_size, seq_len, vocab_size, generator)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


if __name__ == "__main__":
    sys.exit(main())
