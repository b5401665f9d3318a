"""A learner update right after a rollout server sampled, against the same update once it is idle.

    python benchmarks/bench_engine_idle.py --config configs/toy_grpo_servers.toml

On a CPU machine a rollout server shares the trainer's cores. vLLM 0.32's engine core and
worker spin for a second after every message (titan_learner.vllm.cpu_spin), and a GRPO step
trains right after its rollout. This script starts a `titan-learner serve` of the config in its
own session, as a user starts one in another shell (Linux then shares the CPU between the two
sessions, not between their threads), on a free loopback port, then, in this process, builds
the learner, pushes its weights to the server and, each repeat, samples one step's rollout of
the config's own prompts (its train files, through its tokenizer) on the server and takes one
update on it twice (the same work; the weights move on):
  after   at once, as the job does
  idle    after --idle-s seconds with nothing sent to the server (the baseline)
Prints the median of each and after / idle: ~1 where the server sleeps as soon as it is idle.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch
from result_file import add_result_argument, write_result

from titan_learner.cli import add_config_arguments, config_from_arguments
from titan_learner.learner.local import LocalLearner
from titan_learner.weights.sinks import GeneratorSink, push_weights

BUCKET = 64 << 20
START_TIMEOUT_S = 600


def start_server(args: argparse.Namespace, port: int, token: str, log: Path) -> subprocess.Popen:
    """`titan-learner serve` of this run's config in a session of its own, healthy."""
    overrides = [flag for pair in args.overrides or [] for flag in ("--set", pair)]
    command = [sys.executable, "-m", "titan_learner", "serve", "--config", args.config]
    server = subprocess.Popen(
        [*command, *overrides, "--port", str(port)],
        env={**os.environ, "TITAN_LEARNER_SERVER_TOKEN": token},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}: {log.read_text()}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S} s")


def timed_updates(learner, generator, prompts, config, args) -> dict[str, list[float]]:
    """`prompts`: token ids, one step's worth after another, cycled."""
    from titan_learner.job.advantage import group_advantages

    rollout_cfg = config.rollout
    per_step = rollout_cfg.prompts_per_step
    seconds: dict[str, list[float]] = {"after": [], "idle": []}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        seeds = torch.Generator().manual_seed(repeat)
        rollout = generator.generate(
            [prompts[(repeat * per_step + i) % len(prompts)] for i in range(per_step)],
            rollout_cfg.group_size,
            rollout_cfg.max_new_tokens,
            rollout_cfg.temperature,
            seeds,
        )
        rewards = torch.rand(len(rollout.completion_ids), generator=seeds)
        batch = rollout.to_batch(group_advantages(rewards, rollout.group_size), rewards)
        for case in ("after", "idle"):
            if case == "idle":
                time.sleep(args.idle_s)
            began = time.perf_counter()
            learner.update(batch.clone())
            if repeat:
                seconds[case].append(time.perf_counter() - began)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, default="configs/toy_grpo_servers.toml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=1.5)
    add_result_argument(parser, "engine_idle")
    args = parser.parse_args()
    config = config_from_arguments(args)

    from titan_learner.config.derived import longest_sequence
    from titan_learner.data.loader import load_prompts
    from titan_learner.data.tokenizer import load_tokenizer
    from titan_learner.model.hf_config import hf_config
    from titan_learner.vllm.server_generator import ServerGenerator

    tokenizer = load_tokenizer(config)
    prompts = [p.ids for p in load_prompts(config, tokenizer, config.data.train_files).prompts]

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(args, port, token, Path(scratch) / "server.log")
        try:
            learner = LocalLearner(config)
            generator = ServerGenerator(
                [f"http://127.0.0.1:{port}"],
                hf_config(learner.spec),
                eos_id=tokenizer.eos_ids,
                pad_id=tokenizer.pad_id,
                dtype=torch.float32,
                sequence_len=longest_sequence(config),
                sender=True,
                token=token,
            )
            push_weights(learner, GeneratorSink(generator), BUCKET, dtype=torch.float32)
            seconds = timed_updates(learner, generator, prompts, config, args)
        finally:
            server.terminate()
            server.wait(60)
    after, idle = (statistics.median(seconds[case]) for case in ("after", "idle"))
    ratio = after / idle
    print(
        f"update right after the server's rollout: {after * 1e3:.1f} ms (median of {args.repeats})"
    )
    print(f"update with the server idle:             {idle * 1e3:.1f} ms")
    print(f"after / idle: {ratio:.2f}")
    write_result(
        args.result_json,
        benchmark="an update beside a rollout server on the same CPU",
        metric="time, update right after the server's rollout / with the server idle",
        ratio=f"{ratio:.2f}",
        details={"after_ms": after * 1e3, "idle_ms": idle * 1e3, "repeats": args.repeats},
    )


if __name__ == "__main__":
    sys.exit(main())
