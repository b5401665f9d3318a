"""Reward scoring: the math reward over 1 and over N worker processes, and a reward model's rows/s.

    python benchmarks/bench_rewards.py [--completions 4096] [--workers 2] [--repeats 3]
        [--reward-model DIR] [--rows 256] [--batch-size 16] [--max-length 512]

math: `[[reward]] function = "math"` (math-verify) on GSM8K-shaped completions of varied
length and form (boxed fractions, decimals, thousands separators, wrong answers, none), through
the job's own runner (`titan_learner.rewards.runner.score`) with `workers = 1` and with
`workers = N`; the pools are started before the clock. Printed: the median seconds of each and
`ratio 1/N workers` (the speed-up), that both gave the same scores, and the cores each pool
actually got (its workers' CPU seconds over the wall time, from /proc): on a shared machine the
speed-up is bounded by what the other processes leave.

reward model: rows/s of `[[reward]] model = DIR` (default: a random Llama of 256 hidden units
and 4 layers with a byte-level tokenizer, made in a temporary directory) scoring prompt +
completion pairs rendered through its chat template, on the CPU, float32.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from result_file import add_result_argument, write_result

from titan_learner.config.toml import config_from_dict
from titan_learner.rewards.reward_model import RewardModel
from titan_learner.rewards.runner import build_rewards, close_rewards, score

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STEPS = [
    "First, {a} + {b} = {s}.",
    "Then she sold half as many, so {a} / 2 = {h}.",
    "We multiply {a} * {b} to get {p}.",
    "Subtracting, {p} - {a} = {d}.",
    "Let me check this again carefully.",
]


def completion(rng: random.Random) -> tuple[str, str, str]:
    """A (prompt, completion, gold answer) triple shaped like GSM8K's."""
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    values = {"a": a, "b": b, "s": a + b, "h": a / 2, "p": a * b, "d": a * b - a}
    body = " ".join(rng.choice(STEPS).format(**values) for _ in range(rng.randint(1, 12)))
    gold = str(a * b)
    form = rng.randrange(6)
    if form == 0:
        answer = f"\\boxed{{{a * b}}}"
    elif form == 1:
        answer = f"The answer is {a * b:,}."
    elif form == 2:
        answer = f"\\boxed{{\\frac{{{2 * a * b}}}{{2}}}}"
    elif form == 3:
        answer = f"So it is {a * b}.0 in total."
    elif form == 4:
        answer = f"\\boxed{{{a * b + rng.randint(1, 9)}}}"  # wrong
    else:
        answer = "I am not sure."
    return f"What is {a} times {b}?", f"{body} {answer}", f"#### {gold}"


def cpu_seconds(rewards) -> float:
    """User + system CPU time of the rewards' worker processes so far (Linux /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for worker in rewards[0].pool.workers:
        fields = Path(f"/proc/{worker.process.pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def bench_math(completions: int, workers: int, repeats: int) -> dict:
    rng = random.Random(0)
    triples = [completion(rng) for _ in range(completions)]
    prompts, texts = [t[0] for t in triples], [t[1] for t in triples]
    rows = [{"answer": t[2]} for t in triples]
    origins = [f"bench:{i}" for i in range(completions)]
    seconds, scores, cores = {}, {}, {}
    pools = {}
    for count in (1, workers):
        config = config_from_dict({"reward": [{"function": "math", "workers": count}]})
        pools[count] = build_rewards(config)
        score(pools[count], prompts[:8], texts[:8], rows[:8], origins[:8])  # start the workers
    try:
        for _ in range(repeats):  # alternating, so that the machine's drift meets both alike
            for count, rewards in pools.items():
                start, cpu = time.perf_counter(), cpu_seconds(rewards)
                scored = score(rewards, prompts, texts, rows, origins)
                wall = time.perf_counter() - start
                seconds.setdefault(count, []).append(wall)
                cores.setdefault(count, []).append((cpu_seconds(rewards) - cpu) / wall)
                scores[count] = scored.total
    finally:
        for rewards in pools.values():
            close_rewards(rewards)
    one, many = statistics.median(seconds[1]), statistics.median(seconds[workers])
    same = torch.equal(scores[1], scores[workers])
    print(f"math over {completions} completions (mean score {float(scores[1].mean()):.3f}):")
    for count, median in ((1, one), (workers, many)):
        runs = ", ".join(f"{s:.2f} s" for s in seconds[count])
        got = ", ".join(f"{c:.2f}" for c in cores[count])
        print(
            f"  {count} worker(s): {median:.2f} s ({completions / median:.0f} rows/s); "
            f"runs {runs}; cores got {got}"
        )
    print(f"  same scores: {same}")
    print(f"ratio 1/{workers} workers: {one / many:.2f}")
    return {"seconds": seconds, "cores": cores}


def make_reward_model(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForSequenceClassification,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.utils import logging as hf_logging

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(1)
    core.train_from_iterator([" ".join(completion(rng)) for _ in range(200)], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(directory))
    return directory


def bench_reward_model(
    directory: Path | None, rows: int, batch_size: int, max_length: int, repeats: int
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = directory or make_reward_model(Path(scratch) / "reward-model")
        model = RewardModel(path, "cpu", "float32", batch_size, max_length)
        rng = random.Random(2)
        triples = [completion(rng) for _ in range(rows)]
        prompts, texts = [t[0] for t in triples], [t[1] for t in triples]
        model.score(prompts[:batch_size], texts[:batch_size])  # warm up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            scored = model.score(prompts, texts)
            seconds.append(time.perf_counter() - start)
        tokens = sum(len(model.ids(p, c)[0]) for p, c in zip(prompts, texts, strict=True))
    median = statistics.median(seconds)
    print(
        f"reward model ({'given' if directory else 'random 256x4 Llama'}, batch {batch_size}, "
        f"{tokens / rows:.0f} tokens a row, {scored.truncated} truncated): "
        f"{rows / median:.1f} rows/s ({median:.2f} s for {rows} rows, runs {seconds})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--completions", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2, help="the pool compared with 1")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    parser.add_argument("--reward-model", type=Path, default=None, help="a HF directory")
    parser.add_argument("--rows", type=int, default=256, help="pairs the reward model scores")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    add_result_argument(parser, "rewards")
    args = parser.parse_args(argv)
    if min(args.completions, args.rows, args.batch_size, args.repeats) < 1 or args.workers < 2:
        parser.error("counts must be >= 1 and --workers >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measured = bench_math(args.completions, args.workers, args.repeats)
    one, many = (statistics.median(measured["seconds"][n]) for n in (1, args.workers))
    write_result(
        args.result_json,
        benchmark=f"rule rewards over worker processes (math-verify, {args.completions:,} "
        "completions)",
        metric=f"time, 1 worker / {args.workers} workers",
        ratio=f"{one / many:.2f}",
        details=measured,
    )
    bench_reward_model(args.reward_model, args.rows, args.batch_size, args.max_length, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
