"""Every check a run gets before any compute: `validate(config, world_size)`.

On top of what the file alone decides (`config.validate.validate_fields`, which `load_config`
already ran): the layout against the world size, the job (`job.checks`: data files and their
keys, the tokenizer, the rewards, the vLLM engines), the device and attention backend this
machine has, the Hugging Face checkpoint directory, and the model shape (flavor, overrides,
heads divisible by tp) from a build on the meta device. `train` and `check` both run it, so
`check` never approves what `train` rejects. It lives above the job and the model it checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.config.validate import (
    attention_backend,
    check_world_size,
    device_type,
    require_hf_checkpoint,
    validate_fields,
)
from titan_learner.job.checks import check_job_inputs, check_job_structure, check_sequence_length
from titan_learner.vllm.checks import check_vllm_installed

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
    trainable: int  # parameters the optimizer steps: all, or [model.lora]'s adapters
    warnings: list[str] = field(default_factory=list)


def validate(
    config: Config, world_size: int, *, on_this_machine: bool = True, job: bool = True
) -> Validated:
    """Run every check; return the resolved layout, device, attention and parameter count.

    on_this_machine=False (`check` on a laptop for a cluster run): what depends on the machine
    (a CUDA device, flex attention, the local `hf_checkpoint` directory) is reported in
    `warnings` instead of raised, and the device resolves to what the config asks for.
    job=False skips the GRPO job's rules (a config that only builds a learner). A vLLM job's
    vllm install is checked first and raised on any machine: the later checks import it.
    """
    validate_fields(config)
    dp_replicate, dp_shard, tp = check_world_size(config, world_size)
    if job:
        if config.rollout.generator == "vllm":
            check_vllm_installed(config)  # before any check imports vllm or psutil
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
        check_sequence_length(config, shape.max_seq_len)
        check_job_inputs(
            config,
            lambda check: machine_check(check, lambda: None),
            shape.vocab_size,
            world_size,
            dp_replicate * dp_shard,
        )
    return Validated(
        world_size=world_size,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=tp,
        device_type=device,
        attention=attention,
        parameters=shape.parameters,
        trainable=shape.trainable,
        warnings=warnings,
    )


def _requested_device(config: Config) -> str:
    """The device a config asks for, on the machine it is meant for ('auto': CUDA)."""
    return "cuda" if config.learner.device == "auto" else config.learner.device


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    trainable: int
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
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        vocab_size=spec.model.vocab_size,
        max_seq_len=spec.model.layers[0].attention.rope.max_seq_len,
    )
