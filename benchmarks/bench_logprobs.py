"""Peak memory of GRPO token log-probs + backward: dense [B, T, V] logits against chunked.

    python benchmarks/bench_logprobs.py [--vocab 151936] [--batch 2] [--seq-len 2048] [--dim 1024]
                                     [--chunk-size 512] [--entropy] [--device auto] [--json]

What runs is the project's own path after the decoder: TitanPolicy (dense, or chunked with
`logprob_chunk_size`) over a stand-in decoder whose output is a fixed hidden-state parameter
`[B, T, D]` and whose lm_head is a real `Linear(D, V)`, scored by TorchRL's GRPOLoss (response
mask on every token, so the chunked path scores all B * T positions), then backward.

Each variant runs in a fresh subprocess so one cannot inherit the other's heap. On CPU the peak
is the resident-set high-water mark (getrusage ru_maxrss, reset through /proc/self/clear_refs
after the inputs are built) minus the resident set after building them, with
MALLOC_MMAP_THRESHOLD_=131072 so freed buffers go back to the OS and RSS tracks live tensors. On
CUDA it is torch.cuda.max_memory_allocated minus the allocated bytes after building the inputs.
Both include the lm_head weight gradient (V * D * 4 bytes), which either variant must allocate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from result_file import add_result_argument, write_result
from tensordict import TensorDict
from torch import nn
from torchrl.objectives.llm import GRPOLoss

from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.forward.policy import TitanPolicy

GIB = 1024**3
MMAP_THRESHOLD = "131072"


class StandInDecoder(nn.Module):
    """The part of a TorchTitan decoder the log-prob path sees: hidden states and an lm_head."""

    _skip_lm_head = False

    def __init__(self, batch: int, seq_len: int, dim: int, vocab: int, device: str) -> None:
        super().__init__()
        self.hidden = nn.Parameter(torch.empty(batch, seq_len, dim, device=device).normal_())
        self.lm_head = nn.Linear(dim, vocab, bias=False, device=device)
        nn.init.normal_(self.lm_head.weight, std=dim**-0.5)
        self.config = SimpleNamespace(vocab_size=vocab, first_attention=None)

    def forward(self, tokens: torch.Tensor, attention_masks=None) -> torch.Tensor:
        return self.hidden if self._skip_lm_head else self.lm_head(self.hidden)


def grpo_batch(batch: int, seq_len: int, vocab: int, device: str) -> TensorDict:
    """Every token real and trained: the chunked path scores all B * T positions."""
    full = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    data = TensorDict(
        {
            TOKENS_KEY: torch.randint(0, vocab, (batch, seq_len), device=device),
            ATTENTION_MASK_KEY: full,
            ASSISTANT_MASK_KEY: full.clone(),
            ("log_probs", "full"): -torch.rand(batch, seq_len, device=device) * 3.0,
            "advantage": torch.randn(batch, 1, 1, device=device),
        },
        batch_size=[batch],
    )
    return check_batch(data, vocab, needs_ref_log_probs=False)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the current RSS (Linux: writing 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def build(args: argparse.Namespace, batch: int, seq_len: int, dim: int, vocab: int, chunk: int):
    model = StandInDecoder(batch, seq_len, dim, vocab, args.device)
    policy = TitanPolicy(model, logprob_chunk_size=chunk, compute_entropy=args.entropy)
    loss = GRPOLoss(policy, masking_strategy="rlhf", entropy_bonus=args.entropy)
    return loss, grpo_batch(batch, seq_len, vocab, args.device)


def forward_backward(loss: GRPOLoss, data: TensorDict, entropy: bool) -> torch.Tensor:
    out = loss(data)
    total = out.loss_objective + (out.loss_entropy if entropy else 0.0)
    total.backward()
    return total.detach()


def run_variant(args: argparse.Namespace) -> dict:
    """One loss forward + backward; the peak is measured over exactly that.

    A tiny warm-up of the same variant first, so that code pages and allocator pools touched on
    first use are resident before the baseline and do not count as the variant's memory.
    """
    torch.manual_seed(0)
    chunk = args.chunk_size if args.variant == "chunked" else 0
    forward_backward(*build(args, 1, 8, 16, 128, min(chunk, 3)), args.entropy)
    loss, data = build(args, args.batch, args.seq_len, args.dim, args.vocab, chunk)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        reset = True
    else:
        baseline = rss_bytes()
        reset = reset_peak_rss()
    start = time.perf_counter()
    total = forward_backward(loss, data, args.entropy)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    return {
        "variant": args.variant,
        "peak_bytes": peak - baseline,
        "seconds": seconds,
        "loss": float(total),
        "peak_reset": reset,
    }


def spawn(variant: str, argv: list[str]) -> dict:
    """Run one variant in a fresh interpreter with glibc returning freed buffers to the OS."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    command = [sys.executable, __file__, *argv, "--variant", variant, "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen3's vocabulary")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--entropy", action="store_true", help="GRPO's entropy bonus on")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--variant", choices=("dense", "chunked"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    add_result_argument(parser, "logprobs")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def report(args: argparse.Namespace, argv: list[str], dense: dict, chunked: dict) -> None:
    tokens = args.batch * args.seq_len
    method = (
        "torch.cuda.max_memory_allocated - allocated after setup"
        if args.device.startswith("cuda")
        else f"peak RSS (ru_maxrss) - RSS after setup, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    print("command:", shlex.join([sys.executable, *sys.argv[:1], *argv]))
    print(
        f"GRPO token log-probs + backward: {tokens} tokens (B={args.batch}, T={args.seq_len}), "
        f"vocab {args.vocab}, dim {args.dim}, entropy bonus {'on' if args.entropy else 'off'}, "
        f"device {args.device}, torch threads {torch.get_num_threads()}"
    )
    print(f"memory: {method}; one fresh process per variant")
    one_copy = tokens * args.vocab * 4 / GIB
    print(f"(one float32 [tokens, vocab] copy = {one_copy:.2f} GiB)")
    for result, label in ((dense, "dense"), (chunked, f"chunked ({args.chunk_size})")):
        note = "" if result["peak_reset"] else "  (peak not reset: includes setup)"
        print(
            f"  {label:<16} peak {result['peak_bytes'] / GIB:7.2f} GiB   "
            f"time {result['seconds']:7.2f} s   loss {result['loss']:.6f}{note}"
        )
    ratio = chunked["peak_bytes"] / dense["peak_bytes"]
    print(
        f"  chunked / dense peak: {ratio:.3f}   time: {chunked['seconds'] / dense['seconds']:.2f}x"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    passed = [a for a in argv if a != "--json"]
    dense, chunked = spawn("dense", passed), spawn("chunked", passed)
    if args.json:
        print(json.dumps({"args": vars(args), "dense": dense, "chunked": chunked}))
    else:
        report(args, argv, dense, chunked)
    peak = chunked["peak_bytes"] / dense["peak_bytes"]
    write_result(
        args.result_json,
        benchmark="chunked log-probs ("
        + ("Qwen3 vocabulary" if args.vocab == 151_936 else f"vocabulary {args.vocab:,}")
        + ")",
        metric="peak memory, chunked / dense",
        ratio=f"{peak:.3f} ({'with' if args.entropy else 'without'} entropy); time "
        f"{chunked['seconds'] / dense['seconds']:.2f}",
        details={"dense": dense, "chunked": chunked},
    )


if __name__ == "__main__":
    main()
