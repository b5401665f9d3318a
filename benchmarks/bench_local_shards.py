"""What `nccl_m2n` saves the trainer: each rank's own shards against the gathered export.

    torchrun --nproc-per-node 2 benchmarks/bench_local_shards.py --set parallelism.dp_shard=2 ...

Both prepare one update as the rollout servers take it, in the serving dtype (bf16), on every
rank: `nccl` (and `gloo`) send the gathered export (`iter_weights`: every parameter all-gathered,
renamed, cast), `nccl_m2n` sends `LocalShards` (this rank's part, renamed and cast, gathered only
where a conversion crosses shards). The ratio is local shards / gathered export, in the same
process on the same model; bytes are what each rank holds of one update.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from result_file import add_result_argument, print_result, write_result

from titan_learner.cli import add_config_arguments, config_from_arguments
from titan_learner.learner.titan import TitanLearner
from titan_learner.vllm.m2n_source import local_shards

MIB = 1024**2
DTYPE = torch.bfloat16


def timed(pairs) -> tuple[float, int]:
    """Seconds to consume one update's (name, tensor) pairs, and the bytes they held."""
    start, held = time.perf_counter(), 0
    for _, tensor in pairs:
        held += tensor.numel() * tensor.element_size()
    return time.perf_counter() - start, held


def gathered(learner: TitanLearner):
    export = learner.iter_weights(dtype=DTYPE, cpu_offload=False, checksum=False)
    return (pair for bucket in export for pair in bucket)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, default="configs/debug.toml")
    parser.add_argument("--repeats", type=int, default=5)
    add_result_argument(parser, "local_shards")
    args = parser.parse_args()
    learner = TitanLearner.from_config(config_from_arguments(args))
    shards = local_shards(learner.model, learner.spec, DTYPE, dist.get_world_size())
    model_bytes = sum(p.numel() * DTYPE.itemsize for p in learner.model.parameters())

    timed(gathered(learner)), timed(shards)  # warm-up
    runs = [(timed(gathered(learner)), timed(shards)) for _ in range(args.repeats)]
    export_s = min(export[0] for export, _ in runs)
    local_s = min(local[0] for _, local in runs)
    export_bytes, local_bytes = runs[0][0][1], runs[0][1][1]
    sent_whole = sum(plan.placements is None for plan in shards.plans)
    result = {
        "world_size": dist.get_world_size(),
        "model_mib_bf16": model_bytes / MIB,
        "gathered_export_s": export_s,
        "local_shards_s": local_s,
        "local_over_gathered": local_s / export_s,
        "gathered_mib_per_rank": export_bytes / MIB,
        "local_mib_per_rank": local_bytes / MIB,
        "tensors": len(shards.plans),
        "tensors_sent_whole": sent_whole,
    }
    if dist.get_rank() == 0:
        print_result(result)
        write_result(
            args.result_json,
            benchmark=f"nccl_m2n's local shards ({model_bytes / MIB:.0f} MiB bf16)",
            metric="time, local shards / gathered export, per rank",
            ratio=f"{local_s / export_s:.3f} ({dist.get_world_size()} ranks; "
            f"{local_bytes / export_bytes:.2f} x the bytes)",
            details=result,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
