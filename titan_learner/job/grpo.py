"""The GRPO job: `python -m titan_learner train --config FILE [--set k=v ...] [--resume]`.

Prompts -> G sampled completions per prompt (with behaviour log-probs) -> rewards -> group
advantages -> `learner.update` -> new weights to the generator, repeated `[run] steps` times.
The same command runs alone or under `torchrun --nproc-per-node N` (any number of nodes).

Which rank does what: every rank samples the same global prompts from the run seed and keeps its
data-parallel slice; ranks of one tensor-parallel group hold the same slice and, seeded alike,
sample the same completions, so they pass the same batch to `update`. Each rank owns an embedded
generator that receives the learner's full weights after every step.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titan_learner.config.schema import Config
from titan_learner.config.validate import validate
from titan_learner.job.tasks.registry import get_task

BUCKET_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class StepRngs:
    """The job's random streams for one step, derived from (seed, step, data-parallel rank).

    Nothing to checkpoint: a resumed run re-derives exactly the streams it would have had.
    Prompts depend on the step only (every rank draws the same global prompts); sampling also
    on the data-parallel rank (tensor-parallel peers share it, so they sample alike).
    """

    prompts: torch.Generator
    sampling: torch.Generator

    @classmethod
    def for_step(
        cls, seed: int, step: int, data_parallel_rank: int, device: torch.device
    ) -> StepRngs:
        """Sampling draws on the generator's device (a CUDA generator for a CUDA model)."""
        base = seed * 1_000_003 + step
        sampling = torch.Generator(device=device)
        sampling.manual_seed(base * 7919 + 104_729 * (1 + data_parallel_rank))
        return cls(prompts=torch.Generator().manual_seed(base), sampling=sampling)


def build_generator(config: Config, learner, task):
    from titan_learner.model.hf_config import hf_config
    from titan_learner.rollout.hf import HFGenerator
    from titan_learner.rollout.vllm import VLLMGenerator

    if config.rollout.generator == "vllm":
        return VLLMGenerator(config.rollout.model_path, eos_id=task.eos_id, pad_id=task.pad_id)
    return HFGenerator(
        hf_config(learner.spec), eos_id=task.eos_id, pad_id=task.pad_id, device=learner.device
    )


def sync_generator(learner, generator) -> None:
    """Every rank's embedded generator takes the learner's full weights (a collective).

    The tensors never leave the process, so the manifest's names and shapes are checked but the
    bytes are not hashed (on GPU that would copy the whole model to the host every step).
    """
    from titan_learner.weights.sinks import GeneratorSink, push_weights

    push_weights(learner, GeneratorSink(generator), BUCKET_BYTES, cpu_offload=False, checksum=False)


def gather_over(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All data-parallel ranks' values, concatenated (every rank gets all)."""
    if group is None:
        return values
    out = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, values, group=group)
    return torch.cat(out)


def same_within_group(batch, group: dist.ProcessGroup | None):
    """Tensor-parallel peers must train on one batch: take the group's first rank's rollout.

    Peers sample alike from the same seed, but GPU kernels need not be bitwise deterministic,
    and two different batches in one TP group would silently corrupt the update.
    """
    if group is None:
        return batch
    holder = [batch.cpu()]  # an object broadcast: peers' rollouts may even differ in width
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0].to(batch.device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def grpo_step(
    config: Config, learner, generator, task, rngs: StepRngs, reference=None
) -> dict[str, float]:
    """One GRPO step on this rank: rollout, update (in micro-batches), weight push.

    With a `reference` (a `ReferenceModel`, for `kl_to_ref_coeff`), its log-probs join each
    micro-batch (already the same within a tensor-parallel group) before its update; that
    forward is timed as part of `update_s`.
    """
    from titan_learner.job.advantage import group_advantages
    from titan_learner.learner.batch import REF_LOG_PROBS_KEY
    from titan_learner.learner.normalization import step_counts

    rollout_cfg = config.rollout
    dp = learner.capabilities.data_parallel_size
    per_rank = rollout_cfg.prompts_per_step // dp
    prompts = task.sample_prompts(rollout_cfg.prompts_per_step, rngs.prompts)
    mine = prompts[
        learner.data_parallel_rank * per_rank : (learner.data_parallel_rank + 1) * per_rank
    ]

    start = time.perf_counter()
    rollout = generator.generate(
        mine,
        rollout_cfg.group_size,
        rollout_cfg.max_new_tokens,
        rollout_cfg.temperature,
        rngs.sampling,
    )
    rewards = rollout.score(task.reward)
    batch = rollout.to_batch(group_advantages(rewards, rollout_cfg.group_size), rewards)
    batch = same_within_group(batch, learner.tensor_parallel_group)
    rollout_s = time.perf_counter() - start

    start = time.perf_counter()
    metrics: dict[str, float] = {}
    micros = batch.chunk(config.learner.grad_accum_steps)
    counts = step_counts(micros)  # the step's loss is the mean over all of its tokens
    for micro in micros:
        if reference is not None:  # a collective, per micro-batch (bounded like the update)
            micro.set(REF_LOG_PROBS_KEY, reference.log_probs(micro))
        metrics = {k: float(v) for k, v in learner.update(micro, step_counts=counts).items()}
    update_s = time.perf_counter() - start

    start = time.perf_counter()
    sync_generator(learner, generator)
    sync_s = time.perf_counter() - start

    all_rewards = gather_over(rewards, learner.data_parallel_group)
    tokens = gather_over(
        batch.get(("masks", "all_attention_mask")).sum().reshape(1), learner.data_parallel_group
    )
    total_s = rollout_s + update_s + sync_s
    metrics.update(
        reward_mean=float(all_rewards.mean()),
        reward_std=float(all_rewards.std()),
        reward_min=float(all_rewards.min()),
        reward_max=float(all_rewards.max()),
        tokens_per_s=float(tokens.sum()) / total_s,
        rollout_s=rollout_s,
        update_s=update_s,
        weight_sync_s=sync_s,
        peak_memory_gib=peak_memory_gib(learner.device),
        policy_version=float(learner.policy_version),
    )
    return metrics


def run(config: Config, resume: bool = False) -> list[dict[str, float]]:
    """Build everything from the config and run the job; per-step metrics (same on every rank)."""
    from titan_learner.checkpoint.async_save import wait_for_pending_save
    from titan_learner.checkpoint.layout import latest
    from titan_learner.job.reference import ReferenceModel
    from titan_learner.job.telemetry import Telemetry
    from titan_learner.learner.titan import TitanLearner

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(config, world_size)
    task = get_task(config.task.name)
    learner = TitanLearner.from_config(config)
    # The KL anchor: the initial policy, rebuilt from the config (so also on --resume).
    reference = (
        ReferenceModel(config, learner.parallel_dims)
        if config.loss.kwargs.get("kl_to_ref_coeff")
        else None
    )
    rank = dist.get_rank()
    output_dir = Path(config.run.output_dir)
    checkpoints = output_dir / "checkpoints"
    if resume and latest(checkpoints) is not None:
        learner.load(checkpoints)
        if rank == 0:
            print(f"resumed from {latest(checkpoints)} (step {learner.step})", flush=True)
    elif resume and rank == 0:
        print(f"no checkpoint in {checkpoints}: starting from step 0", flush=True)
    generator = build_generator(config, learner, task)
    sync_generator(learner, generator)
    telemetry = (
        Telemetry(output_dir, config.run.steps, start_step=learner.step)
        if rank == 0
        else Telemetry.disabled()
    )
    history = []
    try:
        for step in range(learner.step + 1, config.run.steps + 1):
            rngs = StepRngs.for_step(
                config.run.seed, step, learner.data_parallel_rank, learner.device
            )
            metrics = grpo_step(config, learner, generator, task, rngs, reference)
            history.append(metrics)
            telemetry.log(step, metrics)
            if config.checkpoint.interval and step % config.checkpoint.interval == 0:
                learner.save(
                    checkpoints,
                    keep_latest_k=config.checkpoint.keep_latest_k,
                    asynchronous=config.checkpoint.async_save,
                )
        wait_for_pending_save()
    finally:
        plot = telemetry.close()
    if rank == 0 and plot is not None:
        print(f"curves: {plot}", flush=True)
    return history
