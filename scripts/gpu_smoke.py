"""The Python checks of scripts/gpu_smoke.sh, one per subcommand, each printing one JSON line of
numbers and exiting non-zero when the check fails (never "skipped" with exit 0).

    python scripts/gpu_smoke.py env                 # CUDA and every import the smoke needs
    python scripts/gpu_smoke.py nccl                # torch's libnccl as nccl_m2n's check reads it
    python scripts/gpu_smoke.py parity [--device D] # 3 GRPO updates on D against the CPU reference
    python scripts/gpu_smoke.py chunked [--device D] # chunked log-probs against dense, on D
    python scripts/gpu_smoke.py shared [--device D]  # shared prompts on D against the CPU's rows
    python scripts/gpu_smoke.py job DIR [--device D] [--steps N] [--off-policy-steps K]
                                                    # the toy job, metrics checked
    python scripts/gpu_smoke.py vllm [--device D] [--transfer T]
                                                    # weights into a vLLM engine on D through
                                                    # vLLM's RL API (auto: ipc on a GPU)

--device cpu rehearses parity, chunked and job on a machine without a GPU (the numbers then say
nothing about CUDA); the smoke itself always passes cuda.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

IMPORTS = {  # module -> its distribution; torchtitan.config imports tyro, the top level nothing
    "torch": "torch",
    "tensordict": "tensordict",
    "torchrl": "torchrl",
    "torchtitan.config": "torchtitan",
    "torchdata": "torchdata",
    "transformers": "transformers",
    "xxhash": "xxhash",
}
TOLERANCE = 1e-4  # fp32 with TF32 off: CUDA and CPU kernels sum in other orders


def report(check: str, ok: bool, **numbers) -> int:
    print(json.dumps({"check": check, "ok": ok, **numbers}), flush=True)
    return 0 if ok else 1


def env() -> int:
    import importlib
    from importlib.metadata import version

    versions, missing = {}, []
    for name, distribution in IMPORTS.items():
        try:
            importlib.import_module(name)
            versions[distribution] = version(distribution)
        except Exception as err:  # an import that fails for any reason fails the smoke
            missing.append(f"{name}: {type(err).__name__}: {err}")
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    try:
        import vllm

        versions["vllm"] = vllm.__version__
    except ImportError:
        versions["vllm"] = "not installed: the vLLM GPU checks (NCCL, engine placement) do not run"
    return report(
        "env",
        cuda and not missing,
        error=None if cuda else "no CUDA device",
        python=sys.version.split()[0],
        gpu=gpu,
        missing=missing,
        **versions,
    )


def nccl() -> int:
    """The libnccl.so.2 this process holds, read as nccl_m2n's check reads it (its file, and
    its version through ncclGetVersion), against torch's own account of its NCCL. Whether it
    is new enough for m2n is reported, not required."""
    import torch

    from titan_learner.vllm.m2n_nccl import M2N_MIN_NCCL, loaded_nccl

    expected = tuple(torch.cuda.nccl.version()[:3])
    try:
        path, version = loaded_nccl("libnccl.so.2")
    except OSError as err:
        return report("nccl", False, error=f"{type(err).__name__}: {err}", torch_nccl=expected)
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        pathfinder = load_nvidia_dynamic_lib("nccl").abs_path
    except Exception as err:  # reported: cuda.pathfinder comes with nccl-extensions
        pathfinder = f"{type(err).__name__}: {err}"
    return report(
        "nccl",
        version == expected,
        file=path,
        version=version,
        torch_nccl=expected,
        pathfinder=pathfinder,
        m2n_ready=version >= M2N_MIN_NCCL,
    )


def tiny_config(device: str, n_heads: int = 4, **learner):
    from titan_learner.config.toml import config_from_dict

    overrides = {
        "vocab_size": 512,
        "dim": 128,
        "n_layers": 2,
        "n_heads": n_heads,  # 2 for a vLLM engine: its CPU attention takes head_dim 64, not 32
        "n_kv_heads": 2,
        "hidden_dim": 256,
        "max_seq_len": 64,
    }
    return config_from_dict(
        {
            "model": {"name": "llama3", "overrides": overrides},
            "optimizer": {"lr": 1e-3},
            "learner": {"device": device, **learner},
            "run": {"seed": 0},
        },
        source="gpu_smoke",
    )


def batches(steps: int, grouped: bool = False):
    """Varied rows; grouped: 4 groups of 4 rows sharing a prompt, as a rollout gives them."""
    import torch

    from titan_learner.learner.batch import grouped_synthetic_batch, synthetic_batch

    generator = torch.Generator().manual_seed(0)
    if grouped:
        return [grouped_synthetic_batch(4, 4, 48, 512, generator) for _ in range(steps)]
    return [synthetic_batch(8, 48, 512, generator, varied=True) for _ in range(steps)]


def trained(device: str, steps: int = 3, grouped: bool = False, n_heads: int = 4, **learner):
    import torch

    from titan_learner.learner.local import LocalLearner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = LocalLearner(tiny_config(device, n_heads, **learner))
    losses = []
    for batch in batches(steps, grouped):
        metrics = model.update(batch.to(model.device))
        losses.append(float(metrics["loss_objective"]))
    return model, losses


def max_weight_difference(a, b) -> float:
    import torch

    wa, wb = a.get_weights(dtype=torch.float32), b.get_weights(dtype=torch.float32)
    return max(float((wa[k].cpu() - wb[k].cpu()).abs().max()) for k in wa.keys())


def compare(check: str, device: str, candidate, reference, start: float) -> int:
    """Two (learner, losses) runs: losses and final weights within TOLERANCE."""
    (model, losses), (reference_model, reference_losses) = candidate, reference
    loss_difference = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
    weight_difference = max_weight_difference(model, reference_model)
    ok = loss_difference <= TOLERANCE and weight_difference <= TOLERANCE
    return report(
        check,
        ok,
        device=device,
        max_loss_diff=loss_difference,
        max_weight_diff=weight_difference,
        tolerance=TOLERANCE,
        seconds=round(time.perf_counter() - start, 1),
    )


def parity(device: str) -> int:
    start = time.perf_counter()
    return compare("parity", device, trained(device), trained("cpu"), start)


def chunked(device: str) -> int:
    start = time.perf_counter()
    chunks = trained(device, steps=2, logprob_chunk_size=16)
    dense = trained(device, steps=2, logprob_chunk_size=0)  # the default chunks too (1024)
    return compare("chunked", device, chunks, dense, start)


def shared(device: str) -> int:
    """[learner] share_prompts on `device` (SDPA, picked by auto) against the CPU's rows."""
    start = time.perf_counter()
    candidate = trained(device, grouped=True, share_prompts=True)
    return compare("shared", device, candidate, trained("cpu", grouped=True), start)


def job(directory: str, device: str, steps: int, off_policy_steps: int = 0) -> int:
    """The embedded default through the command line users run, then its metrics.jsonl.

    With `off_policy_steps` k > 0 (check `job_k`): rollouts sampled ahead in a thread; the
    trainer-vs-generator mismatch must be reported on every step, stale ones included. Both
    report their mean tokens/s, the number to compare before the GPU configs default to k = 1.
    """
    import math
    from pathlib import Path

    from titan_learner.cli import main as cli

    start = time.perf_counter()
    sets = {
        "run.steps": steps,
        "run.output_dir": f'"{directory}"',
        "learner.device": f'"{device}"',
        "eval.every_steps": 0,
        "checkpoint.interval": steps,
        "rollout.max_off_policy_steps": off_policy_steps,
    }
    argv = ["train", "--config", "configs/toy_grpo.toml", "--overwrite"]
    code = cli(argv + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    path = Path(directory) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    train = [r for r in rows if "training/reward_mean" in r]
    finite = all(math.isfinite(v) for r in train for v in r.values() if isinstance(v, (int, float)))
    mismatch = [r.get("training/logprob_mismatch_max") for r in train]
    every_step = bool(train) and None not in mismatch
    later = [r["training/tokens_per_s"] for r in train[1:]]  # the first step warms up
    return report(
        "job" if off_policy_steps == 0 else f"job_k{off_policy_steps}",
        code == 0 and len(train) == steps and finite and every_step,
        device=device,
        exit_code=code,
        steps=len(train),
        finite=finite,
        reward_first=train[0]["training/reward_mean"] if train else None,
        reward_last=train[-1]["training/reward_mean"] if train else None,
        update_s=train[-1].get("training/update_s") if train else None,
        tokens_per_s=sum(later) / len(later) if later else None,
        staleness_max=max((r["training/staleness_max"] for r in train), default=None),
        logprob_mismatch_max=max(mismatch) if every_step else None,
        mismatch_every_step=every_step,
        seconds=round(time.perf_counter() - start, 1),
    )


def vllm_transfer(device: str, transfer: str, sleep_level: int = 0) -> int:
    """A colocated vLLM engine on `device` takes a trained learner's weights through backend
    `transfer` and then serves what transformers computes with them (greedy tokens equal,
    log-probs within TOLERANCE in fp32). With `sleep_level` 1 it sleeps between rollouts: the
    GPU memory it gives back while asleep is reported."""
    import tempfile
    from pathlib import Path

    import torch

    from titan_learner.learner.local import LocalLearner
    from titan_learner.model.hf_config import hf_config
    from titan_learner.rollout.hf import HFGenerator
    from titan_learner.vllm.generator import VLLMGenerator
    from titan_learner.weights.sinks import GeneratorSink, SafetensorsDirSink, push_weights

    start = time.perf_counter()
    learner, _ = trained(device, n_heads=2)
    spec = hf_config(learner.spec)
    f32 = torch.float32
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "model"
        push_weights(
            LocalLearner(tiny_config(device, n_heads=2)),
            SafetensorsDirSink(directory, spec),
            1 << 20,
        )
        engine = VLLMGenerator(
            str(directory),
            eos_id=0,
            pad_id=0,
            dtype=f32,
            device=torch.device(device),
            weight_transfer=transfer,
            sleep_level=sleep_level,
            enforce_eager=True,
            max_model_len=64,
            gpu_memory_utilization=0.3,
        )
        try:
            pushed = time.perf_counter()
            push_weights(learner, GeneratorSink(engine), 1 << 20, dtype=f32, cpu_offload=False)
            push_s = time.perf_counter() - pushed
            prompts = [[5, 6, 7], [8, 9, 10, 11]]
            rng = torch.Generator(device=device).manual_seed(0)
            served = engine.generate(prompts, 1, 8, 0.0, rng)
            freed = 0.0
            if sleep_level:
                asleep = torch.cuda.mem_get_info()[0]
                engine._sleep.wake("weights", "kv_cache")
                freed = (asleep - torch.cuda.mem_get_info()[0]) / 2**30
        finally:
            engine.close()
    reference = HFGenerator(spec, eos_id=0, pad_id=0, device=torch.device(device))
    reference.load_weights(learner.get_weights(dtype=f32).items(), version=learner.policy_version)
    expected = reference.generate(prompts, 1, 8, 0.0, torch.Generator(device=device).manual_seed(0))
    same_tokens = torch.equal(served.completion_tokens.cpu(), expected.completion_tokens.cpu())
    real = served.completion_tokens.cpu() != 0
    difference = (served.completion_log_probs.cpu() - expected.completion_log_probs.cpu())[real]
    worst = difference.abs().max().item() if real.any() else float("nan")
    return report(
        "vllm",
        same_tokens and worst <= TOLERANCE and (freed > 0 or not sleep_level),
        device=device,
        weight_transfer=engine.weight_transfer,
        sleep_level=sleep_level,
        freed_while_asleep_gib=round(freed, 2),
        same_greedy_tokens=same_tokens,
        logprob_diff_max=worst,
        push_s=round(push_s, 4),
        seconds=round(time.perf_counter() - start, 1),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "check", choices=["env", "nccl", "parity", "chunked", "shared", "job", "vllm"]
    )
    parser.add_argument("directory", nargs="?", default="outputs/gpu_smoke/toy")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--off-policy-steps", type=int, default=0, help="job: max_off_policy_steps")
    parser.add_argument("--transfer", default="auto", help="vllm: [rollout.vllm] weight_transfer")
    parser.add_argument(
        "--sleep-level", type=int, default=0, help="vllm: [rollout.vllm] sleep_level"
    )
    args = parser.parse_args()
    if args.check == "env":
        return env()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return report(args.check, False, error="no CUDA device")
    if args.check == "nccl":
        return nccl()
    if args.check == "job":
        return job(args.directory, args.device, args.steps, args.off_policy_steps)
    if args.check == "vllm":
        return vllm_transfer(args.device, args.transfer, args.sleep_level)
    return {"parity": parity, "chunked": chunked, "shared": shared}[args.check](args.device)


if __name__ == "__main__":
    sys.exit(main())
