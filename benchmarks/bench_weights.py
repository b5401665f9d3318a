"""Weight export benchmark: throughput against a plain copy, streaming memory against model size.

    python benchmarks/bench_weights.py [--config FILE] [--set k=v ...] [--bucket-mb N] [--json]
    torchrun --nproc-per-node 4 benchmarks/bench_weights.py --set parallelism.dp_shard=2 ...

Throughput: one full export (gather, HF rename, cast, copy to CPU, checksum on rank 0) against
the baseline of copying the same bytes with `Tensor.copy_` in the same process: the ratio is what
the export costs over the memory traffic it cannot avoid. Memory: the resident-set growth while a
streamed export is consumed, against the model's size and against an unbucketed export.
Run with MALLOC_MMAP_THRESHOLD_=131072 so freed buffers go back to the OS and RSS tracks use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from result_file import add_result_argument, print_result, write_result

from titan_learner.cli import add_config_arguments, config_from_arguments
from titan_learner.learner.titan import TitanLearner

MIB = 1024**2


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(export) -> int:
    """Largest RSS growth over the start while the export's buckets are consumed and dropped."""
    start, peak = rss_bytes(), 0
    for bucket in export:
        peak = max(peak, rss_bytes() - start)
        del bucket
    return peak


def timed_export(learner: TitanLearner, bucket_bytes: int) -> tuple[float, int]:
    start = time.perf_counter()
    moved = 0
    for bucket in learner.iter_weights(bucket_bytes=bucket_bytes, dtype=torch.float32):
        moved += sum(t.numel() * t.element_size() for _, t in bucket)
    return time.perf_counter() - start, moved


def timed_plain_copy(model: torch.nn.Module) -> float:
    """The baseline: copy every local parameter's bytes once (what any export must at least do)."""
    start = time.perf_counter()
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        torch.empty_like(local, device="cpu").copy_(local.detach())
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, default="configs/debug.toml")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_result_argument(parser, "weights")
    args = parser.parse_args()
    config = config_from_arguments(args)
    learner = TitanLearner.from_config(config)
    model_bytes = sum(p.numel() * 4 for p in learner.model.parameters())  # fp32, full model
    bucket_bytes = int(args.bucket_mb * MIB)

    timed_export(learner, bucket_bytes)  # warm-up
    export_s = min(timed_export(learner, bucket_bytes)[0] for _ in range(args.repeats))
    # The baseline copies the same number of bytes: the full model, in this rank's pieces x ranks.
    copy_s = min(timed_plain_copy(learner.model) for _ in range(args.repeats))
    copy_s *= dist.get_world_size()
    streamed = peak_rss_growth(learner.iter_weights(bucket_bytes=bucket_bytes, dtype=torch.float32))
    whole = peak_rss_growth(learner.iter_weights(bucket_bytes=2 * model_bytes, dtype=torch.float32))
    result = {
        "world_size": dist.get_world_size(),
        "model_mib": model_bytes / MIB,
        "bucket_mib": bucket_bytes / MIB,
        "export_s": export_s,
        "plain_copy_s": copy_s,
        "export_over_copy": export_s / copy_s,
        "export_gib_per_s": model_bytes / export_s / 1024**3,
        "streamed_peak_mib": streamed / MIB,
        "whole_peak_mib": whole / MIB,
        "streamed_peak_over_model": streamed / model_bytes,
    }
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print_result(result)
        write_result(
            args.result_json,
            benchmark=f"weight export ({model_bytes / MIB:.0f} MiB)",
            metric="time, streamed export / plain copy",
            ratio=f"{export_s / copy_s:.2f} ({dist.get_world_size()} rank(s)); peak "
            f"{streamed / model_bytes:.2f} x the model",
            details=result,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
