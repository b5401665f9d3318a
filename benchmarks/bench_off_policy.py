"""One-step off-policy GRPO against the synchronous loop, on the embedded default.

    python benchmarks/bench_off_policy.py [--off-policy-steps 1] [--target 0.9] [--steps 300]

Runs configs/toy_grpo.toml through `titan_learner.job.grpo.run` three times in this process, as
`benchmarks/bench_job.py` runs it (checkpoints every 50 steps, no evaluation): with
`[rollout] max_off_policy_steps = 0` (sample, train, push, in turn), with `= k` (a thread
samples the next steps while the learner trains, from weights at most k versions old), and
with `= k` and `stale_logprob_mismatch = false` (no kept weights, no scoring forward on stale
steps: what measuring the mismatch there costs). For each:
the step at which the mean sampled reward first reaches --target, the wall time up to it, the
tokens per second over those steps, and the time steps waited for their rollouts; last,
`ratio k/sync (wall to target): X` (k with the stale mismatch measured, the default). On CPU both threads share the cores (half each), so the
gain is bounded by what the cores can run side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_job import describe, run_job
from result_file import add_result_argument, write_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--off-policy-steps", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    add_result_argument(parser, "off_policy")
    args = parser.parse_args()
    k = args.off_policy_steps
    runs = {
        "sync": ["rollout.max_off_policy_steps=0"],
        f"k={k}": [f"rollout.max_off_policy_steps={k}"],
        f"k={k}, no stale mismatch": [
            f"rollout.max_off_policy_steps={k}",
            "rollout.stale_logprob_mismatch=false",
        ],
    }
    results = {
        name: run_job(args.target, args.steps, args.seed, tuple(overrides))
        for name, overrides in runs.items()
    }
    for name, result in results.items():
        print(f"{describe(name, result, args.target)}  {result['tokens_per_s']:,.0f} tokens/s")
    sync, ahead, bare = results.values()
    write_result(
        args.result_json,
        benchmark=f"{'one step' if k == 1 else f'{k} steps'} off-policy vs synchronous",
        metric=f"tokens/s, k={k} / k=0",
        ratio=f"{ahead['tokens_per_s'] / sync['tokens_per_s']:.2f}",
        details={"runs": results},
    )
    print(f"ratio k/sync (tokens/s): {ahead['tokens_per_s'] / sync['tokens_per_s']:.2f}")
    print(
        "ratio k without/with the stale mismatch (tokens/s): "
        f"{bare['tokens_per_s'] / ahead['tokens_per_s']:.2f}"
    )
    if sync["step"] and ahead["step"]:
        print(f"ratio k/sync (wall to target): {ahead['wall_s'] / sync['wall_s']:.2f}")
        return 0
    print("ratio k/sync (wall to target): n/a (a run did not reach the target)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
