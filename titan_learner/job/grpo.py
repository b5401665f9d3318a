"""The GRPO job: `titan-learner train --config FILE [--set k=v ...] [--resume [auto]]`.

Each step: the loader's prompts -> G sampled completions per prompt (with behaviour log-probs)
-> the configured rewards on the decoded completions -> group advantages -> `learner.train_step` ->
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

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.data.loader import Prompt, PromptLoader, load_prompts, rank_slice
from titan_learner.data.tokenizer import PromptTokenizer, load_tokenizer
from titan_learner.job.collectives import (
    from_rank0,
    gather_over,
    raise_everywhere,
    same_within_group,
)
from titan_learner.job.console import Verbosity
from titan_learner.job.episodes import (
    build_episode_setup,
    episode_metrics,
    episode_sample,
    sample_episodes,
)
from titan_learner.job.kl_reward import (
    kl_in_reward,
    penalized,
    reward_estimator,
    uses_reference,
)
from titan_learner.job.reward_shaping import shaped_rewards, without_truncated
from titan_learner.job.run_directory import Resume, RunDirectory
from titan_learner.job.sampled import Sampled, sync_generator
from titan_learner.job.scoring import reward_metrics, score_locally, score_rollout
from titan_learner.job.step_metrics import shaping_metrics
from titan_learner.job.validate import validate
from titan_learner.ranks import rank
from titan_learner.rewards.runner import (
    Reward,
    Scores,
    build_rewards,
    close_rewards,
    load_reward_state,
    reward_state,
)
from titan_learner.rollout.base import FINISHED_KEY

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from titan_learner.env.episode import EpisodeSetup
    from titan_learner.job.telemetry import Telemetry

SAMPLES_PER_LOG = 4


@dataclass(frozen=True)
class JobInputs:
    """Everything read from disk before any compute: tokenizer, prompts, rewards."""

    tokenizer: PromptTokenizer
    train: list[Prompt]
    eval: list[Prompt]
    rewards: list[Reward]
    skipped: int
    episodes: EpisodeSetup | None = None
    """Multi-turn ([env], [[tool]]): what every episode shares; None: single-turn."""


def read_inputs(config: Config) -> JobInputs:
    tokenizer = load_tokenizer(config)
    episodes = build_episode_setup(config, tokenizer)
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
        episodes=episodes,
    )


def sampling_rng(
    seed: int, step: int, data_parallel_rank: int, device: torch.device, attempt: int = 0
) -> torch.Generator:
    """A step's sampling stream, from (seed, step, data-parallel rank, and the round of
    dynamic sampling): nothing to checkpoint; tensor-parallel peers share it, so they sample
    alike. On the generator's device."""
    rng = torch.Generator(device=device)
    base = (seed * 1_000_003 + step) * 7919 + 104_729 * (1 + data_parallel_rank)
    rng.manual_seed((base + attempt * 2_147_483_629) % 2**64)
    return rng


def build_generator(config: Config, learner, tokenizer: PromptTokenizer):
    from titan_learner.dtypes import DTYPES
    from titan_learner.model.hf_config import hf_config
    from titan_learner.rollout.hf import HFGenerator

    ids = {"eos_id": tokenizer.eos_ids, "pad_id": tokenizer.pad_id}
    if config.rollout.generator == "vllm":
        from titan_learner.vllm.build import build_engine_generator, build_server_generator

        dtype = DTYPES[config.learner.export_dtype]
        if config.rollout.vllm.get("servers"):
            return build_server_generator(config, learner, dtype, ids)
        return build_engine_generator(config, learner, dtype, ids)
    return HFGenerator(hf_config(learner.spec), device=learner.device, **ids)


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


def sample(
    config: Config,
    learner,
    generator,
    prompts: list[Prompt],
    rng,
    episodes: EpisodeSetup | None = None,
) -> Sampled:
    """This rank's slice of the step's prompts, G completions each (no collective: the
    asynchronous pipeline calls it from its thread); G episodes each with `episodes`."""
    rollout_cfg = config.rollout
    mine = rank_slice(prompts, learner.data_parallel_rank, learner.capabilities.data_parallel_size)
    start = time.perf_counter()
    if episodes is not None:
        ran = sample_episodes(
            episodes,
            generator,
            mine,
            rollout_cfg.group_size,
            rollout_cfg.max_new_tokens,
            rollout_cfg.temperature,
            rng,
        )
        return Sampled(ran.rollout, mine, time.perf_counter() - start, episodes=ran)
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
    """Rewards, `learner.train_step` (it splits the batch) and `push` (the new weights out)
    for one rollout.

    `waited_s`: how long the step waited for its rollout, when it was sampled ahead of it
    (`rollout_s` is then the sampling's own time, spent alongside earlier updates).

    The rewards are the configured ones plus DAPO's overlong shaping (job.reward_shaping).
    With a `reference` (a `ReferenceModel`: a KL in the loss or the reward, job.kl_reward),
    its log-probs join the batch (already the same within a tensor-parallel group) before the
    advantage, scored in the step's micro-batches (`learner.score_reference`, before the
    reward's KL and `mask_truncated` need them); that forward is timed as part of
    `update_s`. With `[kl] placement = "reward"` the advantage is then taken again from the
    rewards less the KL penalty.

    `on_policy=False` (a batch sampled from older weights): the learner's forward measures no
    engine mismatch, its `logprob_mismatch` is dropped. `before_update(batch)`: metrics
    measured on the step's batch before the update (job.behaviour: the mismatch of a stale
    batch under the weights that sampled it); timed as part of `update_s`.
    """
    from titan_learner.job.advantage import step_advantages
    from titan_learner.job.step_metrics import rollout_metrics
    from titan_learner.learner.batch import ADVANTAGE_KEY, ATTENTION_MASK_KEY

    group = config.rollout.group_size
    dp_group, device = learner.data_parallel_group, learner.device
    rollout, mine, rollout_s = sampled.rollout, sampled.mine, sampled.seconds

    start = time.perf_counter()
    texts, owners, scores = sampled.scored or score_rollout(
        rollout,
        mine,
        group,
        inputs.tokenizer,
        inputs.rewards,
        ahead=sampled.ahead,
        episodes=sampled.episodes,
    )
    rewards = shaped_rewards(config, scores.total, rollout.completion_lengths)
    advantage = partial(
        step_advantages, group_size=group, section=config.advantage, group=dp_group, device=device
    )
    advantages, shaped = advantage(rewards)
    batch = rollout.to_batch(advantages, rewards)
    batch = same_within_group(batch, learner.tensor_parallel_group)
    reward_s = time.perf_counter() - start

    start = time.perf_counter()
    measured = before_update(batch) if before_update is not None else {}
    metrics: dict[str, float] = dict(sampled.metrics)
    if sampled.episodes is not None:
        metrics |= episode_metrics(sampled.episodes, dp_group, device)
    if reference is not None:  # the loss's KL reads them, or the reward's below
        batch = learner.score_reference(batch, reference)
    kl_penalty = None
    if kl_in_reward(config):
        estimator = reward_estimator(config)
        batch, kl_penalty = penalized(batch, config.kl.coeff, estimator, lambda r: advantage(r)[0])
    if config.loss.kwargs.get("mask_truncated"):
        batch = without_truncated(batch, batch.get(FINISHED_KEY))
    updated = learner.train_step(batch, reference)  # the batch carries its reference's
    metrics.update({k: float(v) for k, v in updated.items()})
    if not on_policy:  # the learner's weights moved on: not an engine mismatch
        for key in ("logprob_mismatch", "logprob_mismatch_max"):
            metrics.pop(key, None)
    metrics.update(measured)
    update_s = time.perf_counter() - start

    start = time.perf_counter()
    push()
    sync_s = time.perf_counter() - start

    all_rewards = gather_over(scores.total, dp_group, device)
    advantages = gather_over(batch.get(ADVANTAGE_KEY).reshape(-1), dp_group, device)
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
        **rollout_metrics(shaped, advantages, lengths, finished > 0, group),
        **shaping_metrics(
            config,
            all_rewards,
            shaped,
            None if kl_penalty is None else gather_over(kl_penalty, dp_group, device),
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
            "reward": float(scores.total[i]),
            **{f"reward/{name}": float(v[i]) for name, v in scores.per_reward.items()},
            **{f"reward/{name}_reply": r[i] for name, r in scores.replies.items()},
            **episode_sample(sampled.episodes, i, inputs.tokenizer),
        }
        for i in range(0, len(texts), group)[:SAMPLES_PER_LOG]
    ]
    return StepResult(metrics, samples)


def run(
    config: Config,
    resume: Resume = False,
    overwrite: bool = False,
    verbosity: Verbosity = "normal",
) -> list[dict[str, float]]:
    """Build everything from the config and run the job; per-step metrics (same on every rank).

    The run owns `[run] output_dir` (job.run_directory): without `resume` a directory holding
    a previous run is refused, or moved aside with `overwrite`; `resume="auto"` resumes when
    there is a committed checkpoint and starts fresh when there is none, and so does a worker
    group that torchrun restarted. A finished run is not run again (no metrics: nothing to
    do). SIGTERM checkpoints and stops after the current step (job.preemption).
    `verbosity` is what the console shows (job.console): quiet, normal or verbose.
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
        return _run(config, bool(resume), verbosity)
    finally:
        directory.release()


def open_telemetry(
    config: Config, output_dir: Path, start_step: int, verbosity: Verbosity
) -> Telemetry:
    """Rank 0's Telemetry (the other ranks' records nothing), with its W&B run when configured.

    A collective: a W&B run that cannot start (online without a login) stops every rank with
    its one line, not rank 0 alone, which would leave the others waiting in the next collective.
    """
    from titan_learner.job.telemetry import Telemetry
    from titan_learner.job.wandb_run import start_wandb

    telemetry, failed = Telemetry.disabled(), None
    if rank() == 0:
        try:
            telemetry = Telemetry(
                output_dir,
                config.run.steps,
                start_step=start_step,
                log_every=config.logging.log_every,
                verbosity=verbosity,
                wandb=start_wandb(config, output_dir, start_step > 0, verbosity == "quiet"),
            )
        except ConfigError as err:
            failed = err
    raise_everywhere(failed)
    return telemetry


def record_tokenizer(config: Config, tokenizer: PromptTokenizer, checkpoints: Path) -> None:
    """Rank 0: the run's serving files beside its checkpoints (data.serving_files), for
    `export`. A failure is a warning: the checkpoints matter more, and an export can still be
    given the tokenizer through --config."""
    from titan_learner.data.serving_files import record_serving_files

    try:
        record_serving_files(config, tokenizer, checkpoints)
    except OSError as err:
        warnings.warn(
            f"the run's tokenizer was not recorded beside {checkpoints} ({err}); an export "
            "will use the config's [tokenizer] directory",
            stacklevel=2,
        )


def own_output_dir(config: Config, resume: Resume, overwrite: bool) -> RunDirectory | None:
    """Rank 0 takes `[run] output_dir` (job.run_directory) and every rank learns the outcome,
    said in one line each: a lock taken over, a run moved aside. None: the run had finished."""
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


def _run(config: Config, resume: bool, verbosity: Verbosity) -> list[dict[str, float]]:
    from titan_learner.checkpoint.async_save import wait_for_pending_save
    from titan_learner.checkpoint.layout import latest
    from titan_learner.job.behaviour import BehaviourScorer
    from titan_learner.job.evaluation import evaluate
    from titan_learner.job.hf_exports import HFExports
    from titan_learner.job.preemption import PreemptionGuard
    from titan_learner.job.reference import ReferenceModel
    from titan_learner.job.resume import (
        check_resume,
        saved_normalizers,
        touches_hyperparameters,
    )
    from titan_learner.job.resume_model import check_resume_model
    from titan_learner.job.rollout_source import make_rollouts
    from titan_learner.job.rollouts import sync_points
    from titan_learner.job.run_directory import mark_finished
    from titan_learner.learner.titan import TitanLearner

    output_dir = Path(config.run.output_dir)
    checkpoints = output_dir / "checkpoints"
    # A config the checkpoint cannot follow is refused before anything is built or loaded.
    changes = check_resume(checkpoints, config) if resume and latest(checkpoints) else []
    if resume and latest(checkpoints):
        check_resume_model(checkpoints, config)  # what the keys cannot say: the shapes
    inputs = read_inputs(config)  # every input problem surfaces before the model is built
    learner = TitanLearner.from_config(config)
    # The KL anchor: the initial policy, rebuilt from the config (so also on --resume); with
    # LoRA the base itself, the learner's model with its adapters off.
    reference = None
    if uses_reference(config) and config.model.lora is not None:
        reference = ReferenceModel.base_of(config, learner.model, learner.device)
    elif uses_reference(config):
        reference = ReferenceModel(config, learner.parallel_dims)
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
    try:
        telemetry = open_telemetry(config, output_dir, learner.step, verbosity)
    except ConfigError:  # a W&B run that cannot start
        if callable(getattr(generator, "close", None)):
            generator.close()  # a vLLM engine's processes
        raise

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
                inputs.episodes,
            )
            telemetry.log(step, found, namespace="eval/")
            telemetry.completions(step, output_dir / "eval" / f"step_{step}.jsonl")

    history = []
    every = config.eval.every_steps
    serving_recorded = False

    exports = HFExports(checkpoints) if rank() == 0 and config.checkpoint.export_hf else None

    def save(
        asynchronous: bool, local: dict[str, torch.Tensor] | None = None, export: bool = False
    ) -> None:
        nonlocal serving_recorded
        if rank() == 0 and not serving_recorded:  # what `export` serves with: once a launch
            record_tokenizer(config, inputs.tokenizer, checkpoints)
            serving_recorded = True
        if exports is not None:
            exports.wait()  # the rotation of this save may remove the step being exported
        handle = learner.save(
            checkpoints,
            keep_latest_k=config.checkpoint.keep_latest_k,
            asynchronous=asynchronous,
            extra={"data": loader.state_dict(), **reward_state(inputs.rewards)},
            local=local,
        )
        if exports is not None and export:
            exports.after_save(handle, learner.step, asynchronous)

    def take_sample(prompts: list[Prompt], step: int, attempt: int = 0) -> Sampled:
        rank, device = learner.data_parallel_rank, learner.device
        rng = sampling_rng(config.run.seed, step, rank, device, attempt)
        sampled = sample(config, learner, generator, prompts, rng, inputs.episodes)
        if config.rollout.max_off_policy_steps:  # in the rollout thread: overlaps the update
            sampled.ahead = score_locally(
                sampled.rollout,
                sampled.mine,
                config.rollout.group_size,
                inputs.tokenizer,
                inputs.rewards,
                sampled.episodes,
            )
        return sampled

    def score(sampled: Sampled) -> tuple[list[str], list[Prompt], Scores]:
        group = config.rollout.group_size
        return score_rollout(
            sampled.rollout,
            sampled.mine,
            group,
            inputs.tokenizer,
            inputs.rewards,
            episodes=sampled.episodes,
        )

    rollouts = None
    try:
        with PreemptionGuard() as preemption:
            if learner.step == 0:
                evaluation(0)
            rollouts = make_rollouts(
                config, learner, generator, loader, take_sample, queued, score=score
            )
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
                    elif config.checkpoint.interval and (
                        step % config.checkpoint.interval == 0 or step == config.run.steps
                    ):  # the last step too: a run's end is never left unsaved
                        save(asynchronous=config.checkpoint.async_save, export=True)
                if stop:
                    break
            wait_for_pending_save()
            if exports is not None:
                exports.wait()
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
