"""The whole GRPO job against the simplest alternative a user could write, on the embedded default.

    python benchmarks/bench_job.py [--target 0.9] [--steps 300] [--seed 0 [1 2 ...]]

(a) job: configs/toy_grpo.toml through `titan_learner.job.grpo.run`, as a user runs it
    (checkpoints every 50 steps, metrics, TensorBoard, curves), without evaluation (the plain
    loop has none), into a temporary directory.
(b) plain: a minimal single-process GRPO loop written directly on transformers + torch with the
    same model size, hyperparameters and seed: `generate` samples G completions per prompt,
    the toy reward, group advantages (r - mean) / (std + 1e-4), the clipped surrogate as a token
    mean, AdamW with gradient clipping, one optimizer step per rollout.

Both run in this process, one after the other, on the same threads. For each: the step at which
the mean sampled reward first reaches --target, the wall time of the steps up to it (from the
first step's start), and the per-phase times over those steps; last, the wall time per step
of each, and `ratio job/plain: X`. With several seeds both run once per seed, and the ratios
are of the times summed over the seeds: one seed's ratio is as much its trajectory (how many
steps each run needs to reach the target, which differs by tens of steps from seed to seed and
moves with any change of rounding) as the speed of the two.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from result_file import add_result_argument, write_result

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "configs" / "toy_grpo.toml"


def run_job(target: float, steps: int, seed: int, overrides: tuple[str, ...] = ()) -> dict:
    """The job on the embedded default: the step reaching `target`, wall time, phases.

    `rollout` is the time steps waited for their rollouts: all of the sampling when it runs in
    turn, what the learner did not hide when it runs ahead (max_off_policy_steps > 0)."""
    from titan_learner.config.toml import load_config
    from titan_learner.job.grpo import run

    with tempfile.TemporaryDirectory() as scratch:
        settings = [
            f'run.output_dir="{scratch}/run"',
            f"run.steps={steps}",
            f"run.seed={seed}",
            "data.eval_files=[]",
            *overrides,
        ]
        history = run(load_config(TOY, settings))
    reached = next((i for i, m in enumerate(history) if m["reward_mean"] >= target), None)
    upto = history[: (reached if reached is not None else len(history) - 1) + 1]
    phases = {
        name: sum(m[key] for m in upto)
        for name, key in (
            ("rollout", "rollout_wait_s"),
            ("reward", "reward_s"),
            ("update", "update_s"),
            ("weight_sync", "weight_sync_s"),
        )
    }
    wall = upto[-1]["elapsed_s"]
    phases["logging+checkpoints"] = wall - sum(phases.values())
    tokens = sum(m["tokens_per_s"] * step_seconds(m) for m in upto)
    return {
        "step": None if reached is None else reached + 1,
        "wall_s": wall,
        "phases": phases,
        "tokens_per_s": tokens / wall,
    }


def step_seconds(metrics: dict) -> float:
    """A step's wall time as its tokens_per_s counts it."""
    return sum(metrics[k] for k in ("rollout_wait_s", "reward_s", "update_s", "weight_sync_s"))


class PlainGRPO:
    """What a user writes without this project: one transformers model samples and trains."""

    def __init__(self, seed: int) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from titan_learner.config.toml import load_config

        config = load_config(TOY)
        self.config = config
        shape = config.model.overrides
        self.tokenizer = AutoTokenizer.from_pretrained(str(TOY.parent / "toy" / "tokenizer"))
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=shape.vocab_size,
                hidden_size=shape.dim,
                intermediate_size=shape.hidden_dim,
                num_hidden_layers=shape.n_layers,
                num_attention_heads=shape.n_heads,
                num_key_value_heads=shape.n_kv_heads,
                max_position_embeddings=shape.max_seq_len,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
            )
        )
        o = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=0.0
        )
        self.rows = [json.loads(line) for line in (TOY.parent / "toy/sort_train.jsonl").open()]
        self.order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(seed))
        self.position = 0
        spec = importlib.util.spec_from_file_location(
            "sort_reward", TOY.parent / "toy/sort_reward.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.score = module.score

    def next_rows(self, n: int) -> list[dict]:
        if self.position + n > len(self.rows):
            self.order, self.position = torch.randperm(len(self.rows)), 0
        picked = self.order[self.position : self.position + n].tolist()
        self.position += n
        return [self.rows[i] for i in picked]

    def step(self) -> tuple[float, dict[str, float]]:
        rollout_cfg, group = self.config.rollout, self.config.rollout.group_size
        rows = self.next_rows(rollout_cfg.prompts_per_step)
        start = time.perf_counter()
        prompts = [self.tokenizer(r["prompt"])["input_ids"] for r in rows for _ in range(group)]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = ids != self.pad
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=rollout_cfg.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=rollout_cfg.max_new_tokens,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
            )
        completion = out[:, width:]
        after_eos = (completion == self.eos).long().cumsum(1) - (completion == self.eos).long()
        response = (after_eos == 0) & (completion != self.pad)
        rollout_s = time.perf_counter() - start

        start = time.perf_counter()
        rewards = torch.tensor(
            [
                self.score(
                    rows[i // group]["prompt"],
                    self.tokenizer.decode(completion[i][response[i]], skip_special_tokens=False),
                    rows[i // group],
                )
                for i in range(len(prompts))
            ]
        )
        grouped = rewards.view(-1, group)
        advantages = (
            (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        ).view(-1)
        reward_s = time.perf_counter() - start

        start = time.perf_counter()
        self.model.train()
        full_mask = torch.cat([mask, response], dim=1)
        positions = (full_mask.long().cumsum(1) - 1).clamp(min=0)  # as generate numbers them
        logits = self.model(
            input_ids=out, attention_mask=full_mask.long(), position_ids=positions
        ).logits[:, width - 1 : -1]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
        ratio = torch.exp(log_probs - log_probs.detach())  # one update per rollout: on-policy
        eps = self.config.loss.kwargs.get("clip_epsilon", 0.2)
        surrogate = torch.minimum(
            ratio * advantages[:, None], ratio.clamp(1 - eps, 1 + eps) * advantages[:, None]
        )
        loss = -(surrogate * response).sum() / response.sum()
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.learner.clip_norm)
        self.optimizer.step()
        update_s = time.perf_counter() - start
        return float(rewards.mean()), {"rollout": rollout_s, "reward": reward_s, "update": update_s}


def run_plain(target: float, steps: int, seed: int) -> dict:
    loop = PlainGRPO(seed)
    phases = {"rollout": 0.0, "reward": 0.0, "update": 0.0}
    started = time.perf_counter()
    for step in range(1, steps + 1):
        reward, times = loop.step()
        for name, seconds in times.items():
            phases[name] += seconds
        if reward >= target:
            return {"step": step, "wall_s": time.perf_counter() - started, "phases": phases}
    return {"step": None, "wall_s": time.perf_counter() - started, "phases": phases}


def describe(name: str, result: dict, target: float) -> str:
    reached = f"step {result['step']}" if result["step"] else "never"
    phases = "  ".join(f"{k} {v:.1f} s" for k, v in result["phases"].items())
    return f"{name:6s} reward >= {target} at {reached} after {result['wall_s']:.1f} s  ({phases})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="one seed, or several: each runs both (same seed for the two), and the ratio is "
        "then over all of them (the steps a trajectory takes to the target vary by tens)",
    )
    add_result_argument(parser, "job")
    args = parser.parse_args()
    results = []
    for seed in args.seed:
        job = run_job(args.target, args.steps, seed)
        plain = run_plain(args.target, args.steps, seed)
        print(f"threads: {torch.get_num_threads()}; steps at most {args.steps}; seed {seed}")
        print(describe("job", job, args.target))
        print(describe("plain", plain, args.target))
        if not (job["step"] and plain["step"]):
            print("ratio job/plain: n/a (a run did not reach the target)")
            return 1
        results.append((job, plain))
        if len(args.seed) > 1:
            print(f"seed {seed}: job/plain {job['wall_s'] / plain['wall_s']:.2f}")
    job_wall, plain_wall = (sum(r[side]["wall_s"] for r in results) for side in (0, 1))
    job_steps, plain_steps = (sum(r[side]["step"] for r in results) for side in (0, 1))
    per_step = (job_wall / job_steps) / (plain_wall / plain_steps)
    over = f" over seeds {', '.join(map(str, args.seed))}" if len(args.seed) > 1 else ""
    print(f"per step{over}: job/plain {per_step:.2f}")
    print(f"ratio job/plain: {job_wall / plain_wall:.2f}{over}")
    write_result(
        args.result_json,
        benchmark="the whole job vs a plain GRPO loop",
        metric=f"wall time to reward {args.target}, job / plain loop",
        ratio=f"{job_wall / plain_wall:.2f}{over}",
        details={"per_step": per_step, "runs": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
