"""Evaluation of the policy on held-out prompts: mean reward, pass@1 and pass@k.

`[eval] samples_per_prompt = k` completions per prompt; a completion passes when its total
reward reaches `pass_threshold`. pass@k is the unbiased estimator of Chen et al. (2021) over the
n = k samples of each prompt (`eval/pass@k`; k is `samples_per_prompt`), averaged over prompts. Prompts are split over data-parallel ranks;
rank 0 writes every completion to `eval/step_<N>.jsonl`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_learner.config.schema import Config
from titan_learner.data.loader import Prompt, rank_slice
from titan_learner.job.collectives import gather_objects
from titan_learner.job.episodes import sample_episodes
from titan_learner.job.scoring import score_rollout
from titan_learner.ranks import rank

if TYPE_CHECKING:
    from titan_learner.env.episode import EpisodeSetup


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn from n, c of which pass, passes): 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    config: Config,
    step: int,
    learner,
    generator,
    tokenizer,
    rewards,
    prompts: list[Prompt],
    output_dir: Path,
    episodes: EpisodeSetup | None = None,
) -> dict[str, float]:
    """Sample, score and summarize the eval prompts (every rank calls it); k episodes per
    prompt with `episodes` (multi-turn), their last turns scored."""
    settings = config.eval
    k = settings.samples_per_prompt
    chosen = prompts[: settings.max_prompts] if settings.max_prompts else prompts
    mine = rank_slice(chosen, learner.data_parallel_rank, learner.capabilities.data_parallel_size)
    rollout, ran = None, None
    if mine:
        rng = torch.Generator(device=learner.device)
        rng.manual_seed(
            config.run.seed * 1_000_003 + 7_777 * (1 + step) + learner.data_parallel_rank
        )
        max_new = settings.max_new_tokens or config.rollout.max_new_tokens
        if episodes is not None:
            ran = sample_episodes(episodes, generator, mine, k, max_new, settings.temperature, rng)
            rollout = ran.rollout
        else:
            rollout = generator.generate(
                [p.ids for p in mine], k, max_new, settings.temperature, rng
            )
    texts, _, scores = score_rollout(
        rollout, mine, k, tokenizer, rewards, learn=False, episodes=ran
    )
    records = []
    for index, prompt in enumerate(mine):
        totals = scores.total[index * k : (index + 1) * k].tolist()
        records.append(
            {
                "origin": prompt.origin,
                "prompt": prompt.text,
                "completions": texts[index * k : (index + 1) * k],
                "rewards": totals,
                "passed": sum(t >= settings.pass_threshold for t in totals),
            }
        )
    everything = [r for part in gather_objects(records, learner.data_parallel_group) for r in part]
    if rank() == 0:
        directory = output_dir / "eval"
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / f"step_{step}.jsonl").open("w", encoding="utf-8") as file:
            for record in everything:
                file.write(json.dumps(record) + "\n")
    rewards_all = [r for record in everything for r in record["rewards"]]
    return {
        "reward_mean": sum(rewards_all) / max(len(rewards_all), 1),
        "pass@1": sum(pass_at_k(k, rec["passed"], 1) for rec in everything)
        / max(len(everything), 1),
        "pass@k": sum(pass_at_k(k, rec["passed"], k) for rec in everything)
        / max(len(everything), 1),
        "prompts": float(len(everything)),
    }
