"""Checkpoint throughput against torch.save/torch.load, and how long an async save blocks training.

    python benchmarks/bench_checkpoint.py [--config FILE] [--set section.key=value ...] [--repeats N]
    torchrun --nproc-per-node N benchmarks/bench_checkpoint.py ...

The model is `--config` (default configs/debug.toml) resized by `--set` overrides; the defaults
below make a ~7 M-parameter llama3 whose checkpoint (weights + two AdamW moments) is ~90 MB.
One update runs first so the optimizer moments exist.

What is measured, per rank (the slowest rank counts), median of `--repeats`:

- save: `checkpoint.save(learner, dir).wait()`: DCP's write of this rank's shards (raw tensor
  records, each hashed as it is written) with fsync, `.metadata` and `checksums.json`, rank 0's
  commit (rename, `latest`).
- torch.save: the same state (this rank's local shards, already composed) into one file, fsync.
- load: `checkpoint.load(learner, dir)`: metadata checks, DCP's read (every record verified)
  into the learner's own tensors, `Learner.load_checkpoint`.
- torch.load: that one file back (`weights_only=True`), timed right after an untimed one.
- async save: how long `checkpoint.save(..., asynchronous=True)` blocks the caller (training
  could run after it returns: the state is cloned first), as a ratio to the synchronous save,
  and when it completes.
- checksums: what hashing costs a save (xxh3 of this rank's records in memory, as the writer
  does), and a verified load against an unverified one (the same step, its checksums.json
  moved aside; the two loads take turns going first).

Throughput is the state's tensor bytes over seconds; a ratio above 1 means faster than
torch. Files go to `--dir` (default: a temporary directory), on the same file system for both;
the page cache is warm for both kinds of read.

glibc is told to keep freed memory for reuse (`steady_allocator`). By default it hands large
blocks back to the kernel and the next allocation pays a page fault per 4 KiB, so a timing
depended on what ran before it: the same torch.load took 19 or 45 ms, and an asynchronous
save's clone 0.07 or 0.15 s, by what else the process had allocated and freed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from result_file import add_result_argument, write_result

from titan_learner import checkpoint
from titan_learner.allocator import keep_freed_memory
from titan_learner.checkpoint import records
from titan_learner.checkpoint.integrity import CHECKSUMS, hash_bytes
from titan_learner.checkpoint.layout import latest
from titan_learner.cli import add_config_arguments
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.learner.batch import synthetic_batch
from titan_learner.learner.titan import TitanLearner

DEFAULT_SIZE = [
    "model.overrides.vocab_size=8192",
    "model.overrides.dim=256",
    "model.overrides.n_layers=4",
    "model.overrides.n_heads=8",
    "model.overrides.n_kv_heads=4",
    "model.overrides.hidden_dim=768",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        epilog="--set is applied after the default size overrides: " + " ".join(DEFAULT_SIZE),
    )
    add_config_arguments(parser, default="configs/debug.toml")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    add_result_argument(parser, "checkpoint")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def local_tensors(state: Any, prefix: str = "") -> dict[str, Any]:
    """This rank's own data of a (nested, DTensor) state: what torch.save would write."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for key, value in state.items():
            out.update(local_tensors(value, f"{prefix}{key}."))
        return out
    if isinstance(state, DTensor):
        state = state.to_local()
    return {prefix.rstrip("."): state}


def tensor_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def slowest(seconds: float) -> float:
    """The max over ranks: a collective operation is as fast as its slowest rank."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def torch_save(state: dict[str, Any], file: Path) -> None:
    with open(file, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def fresh(path: Path) -> Path:
    """An empty directory (rank 0 clears it; every rank waits)."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def hash_state(local: dict[str, Any]) -> None:
    """What a save adds for integrity: xxh3 of every tensor record's bytes, in memory."""
    for value in local.values():
        if isinstance(value, torch.Tensor):
            hash_bytes(records.tensor_bytes(value))


def load_unverified(learner: TitanLearner, root: Path) -> None:
    """The same step loaded without its checksums.json (moved aside, then back)."""
    step = latest(root)
    hidden = step.parent / f"{CHECKSUMS}.hidden"
    if dist.get_rank() == 0:
        (step / CHECKSUMS).rename(hidden)
    dist.barrier()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*no checksums.json")
            checkpoint.load(learner, root)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            hidden.rename(step / CHECKSUMS)


def measure(learner: TitanLearner, base: Path, repeats: int) -> dict[str, list[float]]:
    rank = dist.get_rank()
    local = local_tensors(learner.checkpoint())
    keys = ("save", "torch.save", "load", "torch.load", "async", "async_done")
    times: dict[str, list[float]] = {k: [] for k in (*keys, "checksums", "load unverified")}
    for repeat in range(repeats):
        root = fresh(base / "dcp")
        times["save"].append(timed(lambda root=root: checkpoint.save(learner, root).wait()))
        loads = {
            "load": lambda root=root: checkpoint.load(learner, root),
            "load unverified": lambda root=root: load_unverified(learner, root),
        }
        for kind in sorted(loads, reverse=bool(repeat % 2)):  # either one first, by turns
            times[kind].append(timed(loads[kind]))
        times["checksums"].append(timed(lambda: hash_state(local)))
        file = fresh(base / "torch") / f"rank{rank}.pt"
        times["torch.save"].append(timed(lambda file=file: torch_save(local, file)))
        torch.load(file, weights_only=True)  # untimed: the timed one reuses its memory
        times["torch.load"].append(timed(lambda file=file: torch.load(file, weights_only=True)))
        root = fresh(base / "async")
        dist.barrier()
        start = time.perf_counter()
        handle = checkpoint.save(learner, root, asynchronous=True)
        blocked = time.perf_counter() - start
        handle.wait()
        times["async"].append(slowest(blocked))
        times["async_done"].append(slowest(time.perf_counter() - start))
    return times


def report(times: dict[str, list[float]], nbytes: int, learner: TitanLearner, args) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = nbytes / 1e6
    params = sum(p.numel() for p in learner.model.parameters())
    caps = learner.capabilities
    rows = [
        f"command: {shlex.join([sys.executable, *sys.argv])}",
        f"model: {params / 1e6:.2f} M params; state per rank {mb:.1f} MB (weights + optimizer); "
        f"world {caps.world_size} (dp={caps.data_parallel_size} x tp={caps.tensor_parallel_size})"
        f"; {torch.get_num_threads()} torch thread(s); median of {args.repeats}, slowest rank",
        f"{'':12}{'seconds':>10}{'MB/s':>10}{'vs torch':>10}",
    ]
    for ours, theirs in (("save", "torch.save"), ("load", "torch.load")):
        ratio = med[theirs] / med[ours]
        rows.append(f"{ours:12}{med[ours]:10.3f}{mb / med[ours]:10.0f}{ratio:10.2f}")
        rows.append(f"{theirs:12}{med[theirs]:10.3f}{mb / med[theirs]:10.0f}{1.0:10.2f}")
    rows.append(
        f"async save blocks {med['async']:.3f} s = {med['async'] / med['save']:.2f} x the "
        f"synchronous save; committed after {med['async_done']:.3f} s"
    )
    rows.append(
        f"checksums: hashing the records takes {med['checksums']:.3f} s "
        f"({med['checksums'] / med['save']:.2f} x the save); a verified load takes "
        f"{med['load'] / med['load unverified']:.2f} x an unverified one"
    )
    return "\n".join(rows)


def write_checkpoint_result(path, times: dict[str, list[float]], nbytes: int, learner) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in learner.model.parameters())
    write_result(
        path,
        benchmark=f"checkpoints ({params / 1e6:.0f} M params)",
        metric="throughput vs torch.save / torch.load",
        ratio=f"save {med['torch.save'] / med['save']:.2f}, load "
        f"{med['torch.load'] / med['load']:.2f}; async save blocks {med['async']:.2f} s",
        details={"median_s": med, "state_bytes_per_rank": nbytes},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_freed_memory()  # every timed operation reuses pages earlier ones touched
    try:
        config = load_config(args.config, [*DEFAULT_SIZE, *args.overrides])
        learner = TitanLearner.from_config(config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run = config.run
    generator = torch.Generator().manual_seed(run.seed + learner.data_parallel_rank)
    learner.update(synthetic_batch(run.batch_size, run.seq_len, learner.vocab_size, generator))
    nbytes = tensor_bytes(local_tensors(learner.checkpoint()))
    rank0 = dist.get_rank() == 0
    scratch = [tempfile.mkdtemp(prefix="bench_checkpoint.", dir=args.dir)] if rank0 else [None]
    dist.broadcast_object_list(scratch, src=0)  # every rank writes under rank 0's directory
    try:
        times = measure(learner, Path(scratch[0]), args.repeats)
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(scratch[0], ignore_errors=True)
    if rank0:
        print(report(times, nbytes, learner, args))
        write_checkpoint_result(args.result_json, times, nbytes, learner)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
