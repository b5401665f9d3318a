"""Every check a config gets before any compute, each raising ConfigError with one clear line.

Two levels:
- `validate_fields(config)`: what the file alone decides (cross-field rules, the loss's keyword
  arguments). `load_config` runs it, so a Config that exists has passed it.
- `validate(config, world_size)`: everything a run needs on top: the layout against the world
  size, the job (`titan_learner.job.checks`: data files and their keys, the tokenizer, the
  rewards), the device and attention backend this machine has, the Hugging Face checkpoint
  directory, and the model shape (flavor, overrides, heads divisible by tp) from a build on the
  meta device. `train` and `check` both run it, so `check` never approves what `train` rejects.

The resolvers `device_type` and `attention_backend` are also what the model build uses, so the
answer `validate` checked is the one the run gets.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.loss_values import (
    LOSS_KEYS,
    UNREAD_KEYS,
    check_loss_value,
    correction_table,
)
from titan_learner.config.schema import Config, LossSection

# The TorchRL loss class behind each [loss] name, imported only when one is built or checked
# (gspo: titan_learner.learner.gspo, over GRPOLoss).
LOSS_CLASSES = {"grpo": "GRPOLoss", "dapo": "DAPO", "cispo": "CISPOLoss", "gspo": "GRPOLoss"}
PROJECT_LOSS_KEYS = ("tis_cap", "correction")
"""[loss] keys of this project's own, on top of the TorchRL class's (titan_learner.learner.losses)."""
NAMED_LOSS_KEYS = {"gspo": ("gspo_token",)}
"""[loss] keys of this project's own that one loss name takes."""
T = TypeVar("T")


@dataclass(frozen=True)
class Validated:
    """What a config resolves to on a world size (what `check` prints)."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    device_type: str
    attention: str
    parameters: int
    warnings: list[str] = field(default_factory=list)


def validate(
    config: Config, world_size: int, *, on_this_machine: bool = True, job: bool = True
) -> Validated:
    """Run every check; return the resolved layout, device, attention and parameter count.

    on_this_machine=False (`check` on a laptop for a cluster run): what depends on the machine
    (a CUDA device, flex attention, the local `hf_checkpoint` directory) is reported in
    `warnings` instead of raised, and the device resolves to what the config asks for.
    job=False skips the GRPO job's rules (a config that only builds a learner).
    """
    validate_fields(config)
    dp_replicate, dp_shard, tp = check_world_size(config, world_size)
    if job:
        from titan_learner.job.checks import check_job_structure

        check_job_structure(config, dp_replicate * dp_shard)
    warnings: list[str] = []

    def machine_check(check: Callable[[], T], otherwise: Callable[[], T]) -> T:
        try:
            return check()
        except ConfigError as err:
            if on_this_machine:
                raise
            warnings.append(f"on this machine, {err.where}: {err.detail}")
            return otherwise()

    device = machine_check(lambda: device_type(config), lambda: _requested_device(config))
    attention = machine_check(
        lambda: attention_backend(config, device), lambda: config.model.attention
    )
    machine_check(lambda: require_hf_checkpoint(config), lambda: None)
    shape = check_model_shape(config)
    if job:
        from titan_learner.job.checks import check_job_inputs, check_sequence_length

        check_sequence_length(config, shape.max_seq_len)
        check_job_inputs(config, lambda check: machine_check(check, lambda: None), shape.vocab_size)
    return Validated(
        world_size=world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=tp,
        device_type=device,
        attention=attention,
        parameters=shape.parameters,
        warnings=warnings,
    )


def validate_fields(config: Config) -> None:
    """The rules between fields of one file, and the loss's keyword arguments."""
    p = config.parallelism
    if config.compile.enable and p.tp > 1 and config.activation_checkpoint.mode != "none":
        raise ConfigError(
            "compile with tensor parallel and activation checkpointing together fails in "
            "torch 2.13; allowed: any two of them",
            source=config.source,
            where="[compile] enable",
        )
    learner = config.learner
    if learner.max_tokens_per_microbatch and learner.grad_accum_steps != 1:
        raise ConfigError(
            f"max_tokens_per_microbatch = {learner.max_tokens_per_microbatch} splits each step "
            f"by tokens and grad_accum_steps = {learner.grad_accum_steps} by count; allowed: "
            "one of them (grad_accum_steps = 1 with a token budget)",
            source=config.source,
            where="[learner] max_tokens_per_microbatch",
        )
    if learner.share_prompts and (
        not learner.logprob_chunk_size or config.model.attention == "flex"
    ):
        raise ConfigError(
            "share_prompts runs the decoder on a stream of tokens with TorchTitan's SDPA "
            f"attention and scores it in chunks; got logprob_chunk_size = "
            f"{learner.logprob_chunk_size} and [model] attention = '{config.model.attention}'; "
            'allowed: logprob_chunk_size >= 1 and attention = "sdpa" or "auto"',
            source=config.source,
            where="[learner] share_prompts",
        )
    check_loss_kwargs(config.loss, config.source)


# -- the loss -------------------------------------------------------------------------------------


def loss_class(name: str) -> type:
    """The TorchRL loss class of a [loss] name (imports TorchRL)."""
    import torchrl.objectives.llm as llm_losses

    return getattr(llm_losses, LOSS_CLASSES[name])


def check_loss_kwargs(section: LossSection, source: str) -> None:
    """Reject keyword arguments the chosen TorchRL loss does not take, and values outside what
    it implements (`titan_learner.config.loss_values`). A parameter a TorchRL upgrade adds is
    unknown here until the table describes its values."""
    if section.kwargs:
        takes = inspect.signature(loss_class(section.name).__init__).parameters
        own = (*PROJECT_LOSS_KEYS, *NAMED_LOSS_KEYS.get(section.name, ()))
        allowed = [key for key in LOSS_KEYS if key in takes or key in own]
        unread = [key for key in UNREAD_KEYS if key in takes]
        for key, value in section.kwargs.items():
            if key not in allowed and key not in unread:
                raise ConfigError(
                    f"unknown key '{key}' for loss '{section.name}'{did_you_mean(key, allowed)}; "
                    f"allowed keys: name, {', '.join(sorted(allowed))}",
                    source=source,
                    where="[loss]",
                )
            check_loss_value(key, value, source)
        correction_table(section.kwargs, source)  # tis_cap and [loss.correction] together
    eps = section.kwargs.get("clip_epsilon")
    if section.name == "dapo" and not isinstance(eps, list | tuple) and eps is not None:
        raise ConfigError(
            f"dapo takes an asymmetric clip_epsilon = [low, high], got {eps!r}",
            source=source,
            where="[loss] clip_epsilon",
        )


# -- layout and job -------------------------------------------------------------------------------


def check_world_size(config: Config, world_size: int) -> tuple[int, int, int]:
    """Resolve dp_shard=-1 and check dp_replicate * dp_shard * tp == world_size."""
    p = config.parallelism
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % (p.dp_replicate * p.tp) != 0:
            raise ConfigError(
                f"dp_shard=-1 fills the world, but world size {world_size} is not divisible by "
                f"dp_replicate*tp = {p.dp_replicate * p.tp}",
                source=config.source,
                where="[parallelism] dp_shard",
            )
        dp_shard = world_size // (p.dp_replicate * p.tp)
    if p.dp_replicate * dp_shard * p.tp != world_size:
        raise ConfigError(
            f"dp_replicate*dp_shard*tp = {p.dp_replicate}*{dp_shard}*{p.tp} = "
            f"{p.dp_replicate * dp_shard * p.tp} but the world size is {world_size}; "
            "allowed: a layout whose product equals the number of processes",
            source=config.source,
            where="[parallelism]",
        )
    return p.dp_replicate, dp_shard, p.tp


# -- this machine ---------------------------------------------------------------------------------


def device_type(config: Config, requested: str | None = None) -> str:
    """'auto' means CUDA when present, else CPU; asking for CUDA without it is an error."""
    import torch

    requested = requested or config.learner.device
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "'cuda' but no CUDA device is visible; allowed: auto, cpu",
            source=config.source,
            where="[learner] device",
        )
    return requested


def _requested_device(config: Config) -> str:
    """The device a config asks for, on the machine it is meant for ('auto': CUDA)."""
    return "cuda" if config.learner.device == "auto" else config.learner.device


def attention_backend(config: Config, device: str) -> str:
    """Flex attention has no CPU backward in torch 2.13: CPU runs SDPA (causal only).
    `auto` on CUDA is flex, or SDPA when [learner] share_prompts needs it."""
    requested = config.model.attention
    if requested == "auto":
        return "flex" if device == "cuda" and not config.learner.share_prompts else "sdpa"
    if requested == "flex" and device == "cpu":
        raise ConfigError(
            "'flex' has no backward on CPU in torch 2.13; allowed on CPU: auto, sdpa",
            source=config.source,
            where="[model] attention",
        )
    return requested


def hf_checkpoint_problem(directory: str | None) -> str | None:
    """Why `directory` cannot be loaded as an HF checkpoint, or None when it looks loadable."""
    if directory is None:
        return None
    if not Path(directory).is_dir():
        return f"directory {directory!r} not found; allowed: a local Hugging Face model directory"
    if not any(Path(directory).glob("*.safetensors")):
        return f"no *.safetensors files in {directory!r}"
    return None


def require_hf_checkpoint(config: Config) -> None:
    """Fail before any compute when the configured checkpoint directory is unusable."""
    problem = hf_checkpoint_problem(config.model.hf_checkpoint)
    if problem:
        raise ConfigError(problem, source=config.source, where="[model] hf_checkpoint")


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    vocab_size: int
    max_seq_len: int  # the longest sequence its RoPE tables cover


def check_model_shape(config: Config) -> ModelShape:
    """Build the model on the meta device (flavor, overrides, heads against tp); its size."""
    from titan_learner.model.parallelize import prepare_model_config
    from titan_learner.model.spec import build_meta, model_spec

    spec = model_spec(config.model, "sdpa", config.source)
    prepare_model_config(spec, config)
    model = build_meta(spec, config.source)
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=spec.model.vocab_size,
        max_seq_len=spec.model.layers[0].attention.rope.max_seq_len,
    )
