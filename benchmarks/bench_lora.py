"""LoRA against full fine-tuning of the same model: the push into vLLM, the step, the optimizer.

    python benchmarks/bench_lora.py $S80 --repeats 5 [--rank 16]

One process and the config's model ($S80: the 80 MiB model of bench_vllm_push.py, head_dim 64,
which vLLM's CPU attention takes), float32, rank-`--rank` adapters (alpha 2 x rank) on every
Linear layer, the output head too:

- push: the job's full-weight push into a vLLM engine (`GeneratorSink(VLLMGenerator)`: vLLM's
  RL weight-transfer API with the gloo backend, then vLLM's in-place reload), the baseline,
  against the job's `[model.lora] push = "adapter"` into a vLLM engine serving LoRA over the same
  base (the adapters under PEFT names, written as a PEFT directory, vLLM's add_lora). Both as
  the job pushes (`sync_generator`'s settings); best of --repeats. Target: adapter / full <= 0.1.
- step: `LocalLearner.update` on the same synthetic GRPO batch ([run] batch_size x seq_len),
  LoRA / full, best of --repeats after one warm-up step.
- optimizer: the bytes of the optimizer's state after a step, LoRA / full.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_vllm_push import measured_engine
from result_file import add_result_argument, write_result

from titan_learner.cli import add_config_arguments, config_from_arguments
from titan_learner.config.schema import LoRASection
from titan_learner.learner.batch import synthetic_batch
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.lora import is_adapter
from titan_learner.weights.sinks import GeneratorSink, SafetensorsDirSink, push_weights

BUCKET = 64 << 20
TARGETS = ["wqkv", "wo", "w1", "w2", "w3", "lm_head"]


def best_push(learner, generator, repeats: int, adapters: bool) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        push_weights(
            learner,
            GeneratorSink(generator),
            BUCKET,
            dtype=torch.float32,
            cpu_offload=False,
            checksum=False,
            adapters=adapters,
        )
        times.append(time.perf_counter() - start)
    return min(times)


def best_step(learner, batch, repeats: int) -> float:
    learner.update(batch.clone())  # warm-up: optimizer state, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        learner.update(batch.clone())
        times.append(time.perf_counter() - start)
    return min(times)


def optimizer_bytes(learner) -> int:
    return sum(
        value.numel() * value.element_size()
        for inner in learner.optimizer.optimizers
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser, default="configs/debug.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    add_result_argument(parser, "lora")
    args = parser.parse_args()
    config = config_from_arguments(args)
    from titan_learner.vllm.lora_adapters import adapter_serving

    full = LocalLearner(config)
    spec = hf_config(full.spec)
    model_bytes = sum(p.numel() * 4 for p in full.model.parameters())
    generator = torch.Generator().manual_seed(0)
    vocab = full.vocab_size
    batch = synthetic_batch(config.run.batch_size, config.run.seq_len, vocab, generator)
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        push_weights(full, SafetensorsDirSink(base, spec), BUCKET, dtype=torch.float32)
        lora = LoRASection(rank=args.rank, alpha=2.0 * args.rank, target_modules=TARGETS)
        model = dataclasses.replace(config.model, hf_checkpoint=str(base), lora=lora)
        lora_config = dataclasses.replace(config, model=model)
        adapted = LocalLearner(lora_config)
        adapter_bytes = sum(
            p.numel() * 4 for name, p in adapted.model.named_parameters() if is_adapter(name)
        )
        full_engine = measured_engine(base)
        try:
            push = {"full": best_push(full, full_engine, args.repeats, adapters=False)}
        finally:
            full_engine.close()
        lora_engine = measured_engine(base, lora=adapter_serving(lora_config, adapted.spec))
        try:
            push["adapter"] = best_push(adapted, lora_engine, args.repeats, adapters=True)
        finally:
            lora_engine.close()
    step = {
        "full": best_step(full, batch, args.repeats),
        "lora": best_step(adapted, batch, args.repeats),
    }
    optimizer = {"full": optimizer_bytes(full), "lora": optimizer_bytes(adapted)}
    ratios = {
        "push": push["adapter"] / push["full"],
        "step": step["lora"] / step["full"],
        "optimizer": optimizer["lora"] / optimizer["full"],
    }
    print(
        f"model: {model_bytes / 2**20:.0f} MiB float32; adapters (rank {args.rank}, every "
        f"Linear): {adapter_bytes / 2**20:.2f} MiB; best of {args.repeats}"
    )
    print(
        f"push into vLLM   full {push['full'] * 1e3:7.1f} ms  adapter "
        f"{push['adapter'] * 1e3:7.1f} ms  ratio adapter/full: {ratios['push']:.3f}"
    )
    print(
        f"learner step     full {step['full'] * 1e3:7.1f} ms  lora    "
        f"{step['lora'] * 1e3:7.1f} ms  ratio lora/full: {ratios['step']:.2f}"
    )
    print(
        f"optimizer state  full {optimizer['full'] / 2**20:7.1f} MiB lora "
        f"{optimizer['lora'] / 2**20:7.2f} MiB ratio lora/full: {ratios['optimizer']:.3f}"
    )
    write_result(
        args.result_json,
        benchmark=f"LoRA rank {args.rank} against full fine-tuning ({model_bytes / 2**20:.0f} MiB)",
        metric="vLLM push adapter/full; step lora/full; optimizer state lora/full",
        ratio=f"push {ratios['push']:.3f}; step {ratios['step']:.2f}; "
        f"optimizer {ratios['optimizer']:.3f}",
        details={
            "push_s": push,
            "step_s": step,
            "optimizer_bytes": optimizer,
            "model_bytes": model_bytes,
            "adapter_bytes": adapter_bytes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
