"""The GRPO job: `titan-learner train --config FILE [--set k=v ...] [--resume [auto]]`.

Each step: the loader's prompts -> G sampled completions per prompt (with behaviour log-probs)
-> the configured rewards on the decoded completions -> group advantages -> `learner.update` ->
new weights to the generator; evaluation at step 0, every `[eval] every_steps` and at the end;
checkpoints with the data position. The same command runs alone or under torchrun.

Which rank does what: every rank builds the same global prompts of a step and keeps its
data-parallel slice; ranks of one tensor-parallel group hold the same slice and train on their
first rank's rollout. Each rank owns an embedded generator that receives the learner's full
weights after every step, or samples ahead in a thread with `[rollout] max_off_policy_steps`
(job.rollouts). Rank 0 writes telemetry, samples and eval completions.
"""

from __future__ import annotations

import os
import resource
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_learner.config.schema import Config
from titan_learner.config.validate import validate
from titan_learner.data.loader import Prompt, PromptLoader, load_prompts, rank_slice
from titan_learner.data.tokenizer import PromptTokenizer, load_tokenizer
from titan_learner.job.collectives import (
    from_rank0,
    gather_over,
    raise_everywhere,
    same_within_group,
)
from titan_learner.job.run_directory import Resume, RunDirectory
from titan_learner.job.scoring import Scored, reward_metrics, score_locally, score_rollout
from titan_learner.ranks import rank
from titan_learner.rewards.runner import (
    Reward,
    build_rewards,
    close_rewards,
    load_reward_state,
    reward_state,
)

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from titan_learner.rollout.base import Rollout

BUCKET_BYTES = 64 * 1024**2
SAMPLES_PER_LOG = 4


@dataclass(frozen=True)
class JobInputs:
    """Everything read from disk before any compute: tokenizer, prompts, rewards."""

    tokenizer: PromptTokenizer
    train: list[Prompt]
    eval: list[Prompt]
    rewards: list[Reward]
    skipped: int


def read_inputs(config: Config) -> JobInputs:
    tokenizer = load_tokenizer(config)
    train = load_prompts(config, tokenizer, config.data.train_files)
    held_out = (
        load_prompts(config, tokenizer, config.data.eval_files) if config.data.eval_files else None
    )
    return JobInputs(
        tokenizer=tokenizer,
        train=train.prompts,
        eval=held_out.prompts if held_out else [],
        rewards=build_rewards(config, say=print if rank() == 0 else lambda line: None),
        skipped=train.skipped + (held_out.skipped if held_out else 0),
    )


def sampling_rng(
    seed: int, step: int, data_parallel_rank: int, device: torch.device
) -> torch.Generator:
    """A step's sampling stream, from (seed, step, data-parallel rank): nothing to checkpoint;
    tensor-parallel peers share it, so they sample alike. On the generator's device."""
    rng = torch.Generator(device=device)
    rng.manual_seed((seed * 1_000_003 + step) * 7919 + 104_729 * (1 + data_parallel_rank))
    return rng


def build_generator(config: Config, learner, tokenizer: PromptTokenizer):
    from titan_learner.dtypes import DTYPES
    from titan_learner.model.hf_config import hf_config
    from titan_learner.rollout.hf import HFGenerator

    ids = {"eos_id": tokenizer.eos_ids, "pad_id": tokenizer.pad_id}
    if config.rollout.generator == "vllm":
        dtype = DTYPES[config.learner.export_dtype]
        if config.rollout.vllm.get("servers"):
            return build_server_generator(config, hf_config(learner.spec), dtype, ids)
        return build_engine_generator(config, learner, dtype, ids)
    return HFGenerator(hf_config(learner.spec), device=learner.device, **ids)


def build_engine_generator(config: Config, learner, dtype: torch.dtype, ids: dict):
    """Each rank's own in-process vLLM engine, on the rank's device."""
    from titan_learner.job.checks import longest_sequence
    from titan_learner.job.vllm_checks import engine_model_path, engine_rows
    from titan_learner.model.hf_config import hf_config
    from titan_learner.rollout.vllm import VLLMGenerator
    from titan_learner.vllm.engine_memory import cpu_engine_defaults, job_engine_memory
    from titan_learner.vllm.serve import OWN_KEYS

    # the KV cache is sized for what the job asks, not for the model's longest context
    engine = {"max_model_len": longest_sequence(config)} | {
        key: value for key, value in config.rollout.vllm.items() if key not in OWN_KEYS
    }
    if learner.device.type == "cpu":
        rows = engine_rows(config, learner.capabilities.data_parallel_size)
        memory = job_engine_memory(config, hf_config(learner.spec), rows=rows)
        engine |= cpu_engine_defaults(engine, memory)
    return VLLMGenerator(
        engine_model_path(config),
        dtype=dtype,
        seed=config.run.seed,
        device=learner.device,
        weight_transfer=config.rollout.vllm.get("weight_transfer", "auto"),
        **ids,
        **engine,
    )


def build_server_generator(config: Config, hf_model_config, dtype: torch.dtype, ids: dict):
    """The [rollout.vllm] servers, shared by every rank; rank 0 pushes the weights."""
    from titan_learner.ranks import rank
    from titan_learner.vllm.serve import server_token
    from titan_learner.vllm.server_generator import ServerGenerator

    return ServerGenerator(
        config.rollout.vllm["servers"],
        hf_model_config,
        dtype=dtype,
        sender=rank() == 0,
        weight_transfer=config.rollout.vllm.get("weight_transfer", "auto"),
        token=server_token(config),
        **ids,
    )


def sync_generator(learner, generator) -> None:
    """Every rank's embedded generator takes the learner's full weights (a collective).

    The tensors never leave the process, so the manifest's names and shapes are checked but the
    bytes are not hashed (on GPU that would copy the whole model to the host every step).
    """
    from titan_learner.weights.sinks import GeneratorSink, push_weights

    push_weights(learner, GeneratorSink(generator), BUCKET_BYTES, cpu_offload=False, checksum=False)


def close_quietly(telemetry) -> None:
    """Close the telemetry while another error propagates: its own failure (a full disk while
    plotting, say) is reported as a warning, not raised over the error that matters."""
    try:
        telemetry.close()
    except Exception as err:
        warnings.warn(
            f"closing the telemetry failed too: {type(err).__name__}: {err}", stacklevel=2
        )


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


@dataclass
class StepResult:
    metrics: dict[str, float]
    samples: list[dict]  # a few of this rank's (prompt, completion, rewards) rows


@dataclass
class Sampled:
    """One step's rollout on this rank, and the prompts it answers."""

    rollout: Rollout
    mine: list[Prompt]
    seconds: float
    scored: Scored | None = None
    """Its rewards, computed in the rollout thread when it samples ahead (job.scoring)."""


def sample(config: Config, learner, generator, prompts: list[Prompt], rng) -> Sampled:
    """This rank's slice of the step's prompts, G completions each (no collective: the
    asynchronous pipeline calls it from its thread)."""
    rollout_cfg = config.rollout
    mine = rank_slice(prompts, learner.data_parallel_rank, learner.capabilities.data_parallel_size)
    start = time.perf_counter()
    rollout = generator.generate(
        [p.ids for p in mine],
        rollout_cfg.group_size,
        rollout_cfg.max_new_tokens,
        rollout_cfg.temperature,
        rng,
    )
    return Sampled(rollout, mine, time.perf_counter() - start)


def train_on(
    config: Config,
    learner,
    inputs: JobInputs,
    sampled: Sampled,
    reference=None,
    push: Callable[[], None] = lambda: None,
    waited_s: float | None = None,
    on_policy: bool = True,
    before_update: Callable[[TensorDictBase], dict[str, float]] | None = None,
) -> StepResult:
    """Rewards, update (in micro-batches) and `push` (the new weights out) for one rollout.

    `waited_s`: how long the step waited for its rollout, when it was sampled ahead of it
    (`rollout_s` is then the sampling's own time, spent alongside earlier updates).

    With a `reference` (a `ReferenceModel`, for `kl_to_ref_coeff`), its log-probs join each
    micro-batch (already the same within a tensor-parallel group) before its update; that
    forward is timed as part of `update_s`.

    `on_policy=False` (a batch sampled from older weights): the learner's forward measures no
    engine mismatch, its `logprob_mismatch` is dropped. `before_update(batch)`: metrics
    measured on the step's batch before the update (job.behaviour: the mismatch of a stale
    batch under the weights that sampled it); timed as part of `update_s`.
    """
    from titan_learner.job.advantage import group_advantages
    from titan_learner.job.step_metrics import rollout_metrics
    from titan_learner.learner.batch import ATTENTION_MASK_KEY, REF_LOG_PROBS_KEY
    from titan_learner.learner.normalization import step_counts

    group = config.rollout.group_size
    dp_group, device = learner.data_parallel_group, learner.device
    rollout, mine, rollout_s = sampled.rollout, sampled.mine, sampled.seconds

    start = time.perf_counter()
    texts, owners, scores = score_rollout(
        rollout, mine, group, inputs.tokenizer, inputs.rewards, ahead=sampled.scored
    )
    rewards = scores.total
    batch = rollout.to_batch(group_advantages(rewards, group), rewards)
    batch = same_within_group(batch, learner.tensor_parallel_group)
    reward_s = time.perf_counter() - start

    start = time.perf_counter()
    measured = before_update(batch) if before_update is not None else {}
    metrics: dict[str, float] = {}
    # A token budget: the learner splits the whole batch itself (one call, one step).
    budget = config.learner.max_tokens_per_microbatch
    micros = [batch] if budget else batch.chunk(config.learner.grad_accum_steps)
    counts = None if budget else step_counts(micros)  # the step's mean is over all its tokens
    for micro in micros:
        if reference is not None:  # a collective, per micro-batch (bounded like the update)
            micro.set(REF_LOG_PROBS_KEY, reference.kl_log_probs(micro))
        metrics = {k: float(v) for k, v in learner.update(micro, step_counts=counts).items()}
    if not on_policy:  # the learner's weights moved on: not an engine mismatch
        for key in ("logprob_mismatch", "logprob_mismatch_max"):
            metrics.pop(key, None)
    metrics.update(measured)
    update_s = time.perf_counter() - start

    start = time.perf_counter()
    push()
    sync_s = time.perf_counter() - start

    all_rewards = gather_over(rewards, dp_group, device)
    per_reward = {
        name: gather_over(values, dp_group, device) for name, values in scores.per_reward.items()
    }
    lengths = gather_over(rollout.completion_lengths.float(), dp_group, device)
    finished = gather_over(rollout.finished.float(), dp_group, device)
    tokens = gather_over(batch.get(ATTENTION_MASK_KEY).sum().reshape(1).float(), dp_group, device)
    errors = gather_over(torch.tensor([float(scores.errors)]), dp_group, device)
    waited_s = rollout_s if waited_s is None else waited_s
    total_s = waited_s + reward_s + update_s + sync_s  # this step's wall time
    metrics.update(
        reward_mean=float(all_rewards.mean()),
        reward_std=float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
        reward_min=float(all_rewards.min()),
        reward_max=float(all_rewards.max()),
        **{f"reward/{name}_mean": float(values.mean()) for name, values in per_reward.items()},
        **reward_metrics(scores, dp_group, device),
        reward_errors=float(errors.sum()),
        **rollout_metrics(
            all_rewards, group_advantages(all_rewards, group), lengths, finished > 0, group
        ),
        tokens_per_s=float(tokens.sum()) / total_s,
        rollout_s=rollout_s,
        rollout_wait_s=waited_s,
        reward_s=reward_s,
        update_s=update_s,
        weight_sync_s=sync_s,
        peak_memory_gib=peak_memory_gib(device),
        policy_version=float(learner.policy_version),
    )
    samples = [
        {
            "origin": owners[i].origin,
            "prompt": owners[i].text,
            "rendered_prompt": inputs.tokenizer.tokenizer.decode(owners[i].ids),
            "row": owners[i].row,
            "completion": texts[i],
            "reward": float(rewards[i]),
            **{f"reward/{name}": float(v[i]) for name, v in scores.per_reward.items()},
            **{f"reward/{name}_reply": r[i] for name, r in scores.replies.items()},
        }
        for i in range(0, len(texts), group)[:SAMPLES_PER_LOG]
    ]
    return StepResult(metrics, samples)


def run(config: Config, resume: Resume = False, overwrite: bool = False) -> list[dict[str, float]]:
    """Build everything from the config and run the job; per-step metrics (same on every rank).

    The run owns `[run] output_dir` (job.run_directory): without `resume` a directory holding
    a previous run is refused, or moved aside with `overwrite`; `resume="auto"` resumes when
    there is a committed checkpoint and starts fresh when there is none, and so does a worker
    group that torchrun restarted. A finished run is not run again (no metrics: nothing to
    do). SIGTERM checkpoints and stops after the current step (job.preemption).
    """
    from titan_learner.allocator import keep_freed_memory
    from titan_learner.config.validate import device_type
    from titan_learner.job.run_directory import AUTO, elastic_restarts
    from titan_learner.model.parallelize import init_process_group

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(config, world_size)
    keep_freed_memory()  # each step reuses the pages the last one touched
    init_process_group(device_type(config))  # so that ranks agree on the directory below
    if restarts := elastic_restarts():
        resume = AUTO
        if rank() == 0:
            print(f"torchrun restart {restarts}: resuming as --resume {AUTO}", flush=True)
    directory = own_output_dir(config, resume, overwrite)
    if directory is None:
        return []
    try:
        return _run(config, bool(resume))
    finally:
        directory.release()


def own_output_dir(config: Config, resume: Resume, overwrite: bool) -> RunDirectory | None:
    """Rank 0 takes `[run] output_dir` (job.run_directory) and every rank learns the outcome,
    said in one line each: a lock taken over, a run moved aside. None: the run had finished."""
    from titan_learner.config.errors import ConfigError

    directory = RunDirectory(config.run.output_dir, config.source, config.run.lock_stale_after_s)
    error, acquired = None, None
    if rank() == 0:
        try:
            acquired = directory.acquire(resume=resume, overwrite=overwrite, steps=config.run.steps)
        except ConfigError as err:
            error = err
    raise_everywhere(error)
    acquired = from_rank0(acquired)
    lines = []
    if acquired.took_over is not None:
        holder = acquired.took_over
        lines.append(
            f"taking over the lock of pid {holder.pid} on {holder.host} (no longer running)"
        )
    if acquired.moved is not None:
        lines.append(f"moved the previous run in {config.run.output_dir} to {acquired.moved}")
    if acquired.reused:
        lines.append(
            f"reusing {config.run.output_dir}: its run stopped before its first step (no "
            "committed checkpoint, no metrics row)"
        )
    if acquired.finished is not None:
        lines.append(
            f"{config.run.output_dir} already finished its {acquired.finished} steps "
            f"([run] steps = {config.run.steps}); nothing to do"
        )
    if rank() == 0 and lines:
        print("\n".join(lines), flush=True)
    return None if acquired.finished is not None else directory


def _run(config: Config, resume: bool) -> list[dict[str, float]]:
    from titan_learner.checkpoint.async_save import wait_for_pending_save
    from titan_learner.checkpoint.layout import latest
    from titan_learner.job.behaviour import BehaviourScorer
    from titan_learner.job.evaluation import evaluate
    from titan_learner.job.preemption import PreemptionGuard
    from titan_learner.job.reference import ReferenceModel
    from titan_learner.job.resume import (
        check_resume,
        saved_normalizers,
        touches_hyperparameters,
    )
    from titan_learner.job.resume_model import check_resume_model
    from titan_learner.job.rollouts import make_rollouts, sync_points
    from titan_learner.job.run_directory import mark_finished
    from titan_learner.job.telemetry import Telemetry
    from titan_learner.learner.titan import TitanLearner

    output_dir = Path(config.run.output_dir)
    checkpoints = output_dir / "checkpoints"
    # A config the checkpoint cannot follow is refused before anything is built or loaded.
    changes = check_resume(checkpoints, config) if resume and latest(checkpoints) else []
    if resume and latest(checkpoints):
        check_resume_model(checkpoints, config)  # what the keys cannot say: the shapes
    inputs = read_inputs(config)  # every input problem surfaces before the model is built
    learner = TitanLearner.from_config(config)
    # The KL anchor: the initial policy, rebuilt from the config (so also on --resume).
    reference = (
        ReferenceModel(config, learner.parallel_dims)
        if config.loss.kwargs.get("kl_to_ref_coeff")
        else None
    )
    loader = PromptLoader(inputs.train, config.rollout.prompts_per_step, config.run.seed)
    say = print if rank() == 0 else (lambda *args, **kwargs: None)
    queued: dict[str, torch.Tensor] = {}  # rollouts sampled ahead, saved at a preemption
    if inputs.skipped:
        say(f"skipped {inputs.skipped} prompt(s) longer than max_prompt_tokens", flush=True)
    if resume and latest(checkpoints) is not None:
        if changes:
            say("resuming with changed: " + ", ".join(map(str, changes)), flush=True)
        normalizers = saved_normalizers(checkpoints)
        extra = {"data": loader.state_dict(), **reward_state(inputs.rewards, normalizers)}
        learner.load(
            checkpoints,
            extra=extra,
            local=queued,
            hyperparameters_from_config=touches_hyperparameters(changes),
        )
        loader.load_state_dict(extra["data"])
        load_reward_state(inputs.rewards, extra)
        say(f"resumed from {latest(checkpoints)} (step {learner.step})", flush=True)
    elif resume:
        say(f"no checkpoint in {checkpoints}: starting from step 0", flush=True)
    generator = build_generator(config, learner, inputs.tokenizer)
    sync_generator(learner, generator)
    telemetry = (
        Telemetry(output_dir, config.run.steps, start_step=learner.step)
        if rank() == 0
        else Telemetry.disabled()
    )

    def evaluation(step: int) -> None:
        if inputs.eval:
            found = evaluate(
                config,
                step,
                learner,
                generator,
                inputs.tokenizer,
                inputs.rewards,
                inputs.eval,
                output_dir,
            )
            telemetry.log(step, found, namespace="eval/")

    history = []
    every = config.eval.every_steps

    def save(asynchronous: bool, local: dict[str, torch.Tensor] | None = None) -> None:
        learner.save(
            checkpoints,
            keep_latest_k=config.checkpoint.keep_latest_k,
            asynchronous=asynchronous,
            extra={"data": loader.state_dict(), **reward_state(inputs.rewards)},
            local=local,
        )

    def take_sample(prompts: list[Prompt], step: int) -> Sampled:
        rng = sampling_rng(config.run.seed, step, learner.data_parallel_rank, learner.device)
        sampled = sample(config, learner, generator, prompts, rng)
        if config.rollout.max_off_policy_steps:  # in the rollout thread: overlaps the update
            sampled.scored = score_locally(
                sampled.rollout,
                sampled.mine,
                config.rollout.group_size,
                inputs.tokenizer,
                inputs.rewards,
            )
        return sampled

    rollouts = None
    try:
        with PreemptionGuard() as preemption:
            if learner.step == 0:
                evaluation(0)
            rollouts = make_rollouts(config, learner, generator, loader, take_sample, queued)
            is_sync_point = sync_points(config)
            scorer = (
                BehaviourScorer(config, learner, is_sync_point, start=learner.step)
                if config.rollout.max_off_policy_steps and config.rollout.stale_logprob_mismatch
                else None
            )
            started = time.perf_counter()
            for step in range(learner.step + 1, config.run.steps + 1):
                taken = rollouts.take(step)
                result = train_on(
                    config,
                    learner,
                    inputs,
                    taken.sampled,
                    reference,
                    push=lambda step=step: rollouts.push(step),
                    waited_s=taken.waited_s,
                    on_policy=not taken.staleness,
                    before_update=(
                        None
                        if scorer is None
                        else partial(scorer.before_update, step, version=taken.version)
                    ),
                )

                result.metrics["epoch"] = taken.epoch
                result.metrics["staleness_mean"] = result.metrics["staleness_max"] = float(
                    taken.staleness
                )
                result.metrics["elapsed_s"] = time.perf_counter() - started  # this run's steps
                history.append(result.metrics)
                telemetry.log(step, result.metrics)
                if config.run.log_samples_every and step % config.run.log_samples_every == 0:
                    telemetry.samples(step, result.samples)
                stop = preemption.stop_now(learner.device)
                with rollouts.drained(step, sync=stop or is_sync_point(step)):
                    if (every and step % every == 0) or step == config.run.steps:
                        evaluation(step)
                    if stop:
                        wait_for_pending_save()
                        if (
                            latest(checkpoints) is None
                            or latest(checkpoints).name != f"step-{step}"
                        ):
                            save(asynchronous=False, local=rollouts.queued_state())
                        say(
                            f"preempted (SIGTERM): saved step {step} to {checkpoints}; "
                            "continue with --resume",
                            flush=True,
                        )
                    elif config.checkpoint.interval and step % config.checkpoint.interval == 0:
                        save(asynchronous=config.checkpoint.async_save)
                if stop:
                    break
            wait_for_pending_save()
            rollouts.close()
    except BaseException:
        if rollouts is not None:
            rollouts.close(wait=False)  # an error or Ctrl-C: not after the rollout in flight
        close_quietly(telemetry)  # the plot must never hide the real error
        raise
    finally:
        if callable(getattr(generator, "close", None)):
            generator.close()  # a vLLM engine's processes
        close_rewards(inputs.rewards)  # their worker processes
    plot = telemetry.close()
    if plot is not None:
        say(f"curves: {plot}", flush=True)
    if rank() == 0 and learner.step >= config.run.steps:
        mark_finished(output_dir, learner.step)  # a restart of this run has nothing to do
    return history
