"""The checks of a config that need nothing of ours beyond it, each a ConfigError of one line.

- `validate_fields(config)`: what the file alone decides (cross-field rules, the loss's keyword
  arguments). `load_config` runs it, so a Config that exists has passed it.
- `check_world_size`: the layout against the number of processes.
- This machine: `device_type`, `attention_backend` and the Hugging Face checkpoint directory.
  They are also what the model build uses, so the answer validation checked is the one the run
  gets.

Everything a run needs on top (the job's data, tokenizer and rewards, the model shape, the
engines) is `titan_learner.job.validate.validate`, above the job and the model: config/
imports nothing of ours outside config/.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from titan_learner.config.env_values import check_env
from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.loss_values import (
    LOSS_KEYS,
    UNREAD_KEYS,
    check_loss_value,
    correction_table,
)
from titan_learner.config.schema import Config, LossSection
from titan_learner.config.vllm_keys import ENGINE_LORA_KEYS, ENGINE_LORA_RANKS

# The TorchRL loss class behind each [loss] name, imported only when one is built or checked
# (gspo: titan_learner.learner.loss.gspo, over GRPOLoss).
LOSS_CLASSES = {"grpo": "GRPOLoss", "dapo": "DAPO", "cispo": "CISPOLoss", "gspo": "GRPOLoss"}
PROJECT_LOSS_KEYS = ("tis_cap", "correction", "mask_truncated")
"""[loss] keys of this project's own, on top of the TorchRL class's (titan_learner.learner.loss.classes)."""
NAMED_LOSS_KEYS = {"gspo": ("gspo_token",)}
"""[loss] keys of this project's own that one loss name takes."""


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
    if config.checkpoint.export_hf and not config.checkpoint.interval:
        raise ConfigError(
            "export_hf = true exports each saved step, and interval = 0 saves none; allowed: "
            "interval >= 1, or export_hf = false",
            source=config.source,
            where="[checkpoint] export_hf",
        )
    check_loss_kwargs(config.loss, config.source)
    check_kl(config)
    check_env(config)
    check_adapter_push(config)


def check_adapter_push(config: Config) -> None:
    """[model.lora] push = "adapter": what a vLLM engine can serve as a LoRA adapter over a base
    it loads itself, and where the adapters can go."""
    lora = config.model.lora
    if lora is None or lora.push != "adapter":
        return
    rollout = config.rollout
    problem = None
    if rollout.generator != "vllm":
        problem = (
            f"generator = {rollout.generator!r} takes merged weights; allowed: push = 'merged', "
            "or generator = 'vllm'"
        )
    elif not config.model.hf_checkpoint:
        problem = (
            "the engine loads the frozen base itself from [model] hf_checkpoint, and a base made "
            "from a seed has no directory; allowed: hf_checkpoint, or push = 'merged'"
        )
    elif rollout.model_path and rollout.model_path != config.model.hf_checkpoint:
        problem = (
            f"the engine must start from the base the adapters adapt ([model] hf_checkpoint), "
            f"not [rollout] model_path {rollout.model_path!r}; allowed: model_path unset"
        )
    elif "lm_head" in (lora.target_modules or ()):
        problem = (
            "vLLM serves LoRA adapters on attention and MLP layers, not on lm_head; allowed: "
            "targets without lm_head, or push = 'merged'"
        )
    elif lora.rank > ENGINE_LORA_RANKS[-1]:
        problem = (
            f"rank {lora.rank} is above vLLM's largest LoRA rank; allowed: rank <= "
            f"{ENGINE_LORA_RANKS[-1]}, or push = 'merged'"
        )
    elif any(key in rollout.vllm for key in ENGINE_LORA_KEYS):
        key = next(key for key in ENGINE_LORA_KEYS if key in rollout.vllm)
        problem = f"[rollout.vllm] {key} is set by [model.lora], not there; allowed: leave it out"
    if problem is not None:
        raise ConfigError(problem, source=config.source, where="[model.lora] push")


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


def check_kl(config: Config) -> None:
    """One KL to the reference, in one place: [kl] placement says where, and the coefficient
    lives with it ([loss] kl_to_ref_coeff in the loss, [kl] coeff in the reward)."""
    kl, in_loss = config.kl, config.loss.kwargs.get("kl_to_ref_coeff")
    if kl.placement == "loss" and kl.coeff:
        raise ConfigError(
            f"coeff = {kl.coeff} with placement = 'loss': the KL in the loss is TorchRL's, its "
            "coefficient is [loss] kl_to_ref_coeff; allowed: [loss] kl_to_ref_coeff = "
            f"{kl.coeff}, or [kl] placement = 'reward'",
            source=config.source,
            where="[kl] coeff",
        )
    if kl.placement == "loss" and kl.estimator and not in_loss:
        raise ConfigError(
            f"'{kl.estimator}' with no KL (placement = 'loss' and no [loss] kl_to_ref_coeff) "
            "estimates nothing; allowed: [loss] kl_to_ref_coeff > 0, or placement = 'reward' "
            "with [kl] coeff > 0",
            source=config.source,
            where="[kl] estimator",
        )
    if kl.placement == "reward" and in_loss:
        raise ConfigError(
            f"placement = 'reward' and [loss] kl_to_ref_coeff = {in_loss} would count the KL "
            "twice; allowed: one of them ([kl] coeff for the reward)",
            source=config.source,
            where="[kl] placement",
        )
    if kl.placement == "reward" and not kl.coeff:
        raise ConfigError(
            "placement = 'reward' with coeff = 0 penalizes nothing; allowed: coeff > 0",
            source=config.source,
            where="[kl] coeff",
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
