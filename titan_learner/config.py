"""The TOML schema of a run: one dataclass per section, loaded and validated by `load_config`.

The sections hold what a user writes; `titan_config.py` maps them onto TorchTitan's own config
dataclasses (ParallelismConfig, TrainingConfig, CompileConfig, AC, optimizer, LR scheduler), so
nothing TorchTitan already describes is re-implemented here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from titan_learner.schema import ConfigError, build_dataclass, did_you_mean

POSITIVE = {"min": 1}
NON_NEGATIVE = {"min": 0}

Dtype = Literal["float32", "bfloat16"]


@dataclass
class ModelOverrides:
    """Shape overrides applied on top of the flavor (tiny test models, vocabulary changes)."""

    vocab_size: int | None = field(default=None, metadata=POSITIVE)
    dim: int | None = field(default=None, metadata=POSITIVE)
    n_layers: int | None = field(default=None, metadata=POSITIVE)
    n_heads: int | None = field(default=None, metadata=POSITIVE)
    n_kv_heads: int | None = field(default=None, metadata=POSITIVE)
    head_dim: int | None = field(default=None, metadata=POSITIVE)
    hidden_dim: int | None = field(default=None, metadata=POSITIVE)
    max_seq_len: int | None = field(default=None, metadata=POSITIVE)
    rope_theta: float | None = field(default=None, metadata={"min": 1.0})


@dataclass
class ModelSection:
    name: Literal["llama3", "qwen3"] = "llama3"
    flavor: str = "debugmodel"
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """auto: flex attention on CUDA, SDPA (causal) on CPU where flex has no backward."""
    hf_checkpoint: str | None = None
    """A Hugging Face safetensors directory to load weights from, converted by TorchTitan's adapter."""
    init: Literal["torchtitan", "transformers"] = "torchtitan"
    """Random initial weights without hf_checkpoint: TorchTitan's init, or the matching
    transformers model's (std 0.02 everywhere), which small models trained from scratch prefer."""
    overrides: ModelOverrides = field(default_factory=ModelOverrides)


@dataclass
class ParallelismSection:
    dp_replicate: int = field(default=1, metadata=POSITIVE)
    dp_shard: int = field(
        default=-1, metadata={"min": -1, "not": (0,), "allowed": "-1 (fill the world) or >= 1"}
    )
    """-1 fills the world: world_size / (dp_replicate * tp)."""
    tp: int = field(default=1, metadata=POSITIVE)
    sequence_parallel: bool = True
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    param_dtype: Dtype = "float32"
    reduce_dtype: Literal["float32"] = "float32"


@dataclass
class ActivationCheckpointSection:
    mode: Literal["none", "full", "selective"] = "none"


@dataclass
class CompileSection:
    enable: bool = False
    backend: str = "inductor"


@dataclass
class OptimizerSection:
    name: Literal["AdamW", "Adam"] = "AdamW"
    lr: float = field(default=1e-5, metadata={"min": 0.0})
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = field(default=1e-8, metadata={"min": 0.0})
    weight_decay: float = field(default=0.0, metadata={"min": 0.0})
    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """auto: fused on CUDA, foreach on CPU."""


@dataclass
class LRSchedulerSection:
    warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    decay: Literal["none", "linear", "sqrt", "cosine"] = "none"
    min_lr_factor: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})


@dataclass
class LearnerSection:
    grad_accum_steps: int = field(default=1, metadata=POSITIVE)
    clip_norm: float = field(default=1.0, metadata={"min": 0.0})
    """Global gradient-norm clipping threshold; 0 disables clipping (the norm is still reported)."""
    mixed_precision: bool = False
    """Autocast the forward pass to autocast_dtype (on top of FSDP's param_dtype)."""
    autocast_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """dtype of exported weights (get_weights, iter_weights, sinks): rollout engines run bf16."""
    logprob_chunk_size: int = field(default=0, metadata=NON_NEGATIVE)
    """Token positions per lm_head chunk when the loss scores tokens (0: dense [B, T, V] logits).
    > 0 never holds more than one chunk of [chunk, vocab] float32 logits, in forward or backward."""


@dataclass
class LossSection:
    name: Literal["grpo", "dapo", "cispo"] = "grpo"
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the TorchRL loss class, written as plain keys of [loss] in TOML."""


@dataclass
class RolloutSection:
    generator: Literal["hf", "vllm"] = "hf"
    """hf: an in-process transformers model per rank (the embedded default); vllm: engines."""
    group_size: int = field(default=16, metadata={"min": 2})
    """G completions per prompt; group-relative advantages need at least 2."""
    prompts_per_step: int = field(default=64, metadata=POSITIVE)
    """Prompts per optimizer step over all data-parallel ranks (divisible by their number)."""
    max_new_tokens: int = field(default=8, metadata=POSITIVE)
    temperature: float = field(default=1.0, metadata={"min": 0.0})
    model_path: str | None = None
    """vllm only: the HF directory the engines start from."""


@dataclass
class TaskSection:
    name: str = "sort"


@dataclass
class CheckpointSection:
    interval: int = field(default=0, metadata=NON_NEGATIVE)
    """Save every N steps (0: never)."""
    keep_latest_k: int = field(default=2, metadata=POSITIVE)
    async_save: bool = False


@dataclass
class RunSection:
    seed: int = field(default=0, metadata=NON_NEGATIVE)
    steps: int = field(default=10, metadata=POSITIVE)
    output_dir: str = "outputs/run"
    batch_size: int = field(default=8, metadata=POSITIVE)
    """Sequences per rank per update of the synthetic learner run (train.py before the GRPO job)."""
    seq_len: int = field(default=32, metadata={"min": 2})


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    activation_checkpoint: ActivationCheckpointSection = field(
        default_factory=ActivationCheckpointSection
    )
    compile: CompileSection = field(default_factory=CompileSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    loss: LossSection = field(default_factory=LossSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    task: TaskSection = field(default_factory=TaskSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    source: str = "<config>"


SECTIONS = tuple(name for name in Config.__dataclass_fields__ if name != "source")


def _parse_override(item: str) -> tuple[list[str], Any]:
    malformed = ConfigError(
        f"'{item}': expected SECTION.KEY=VALUE (a TOML value), e.g. parallelism.tp=2",
        source="--set",
    )
    if "=" not in item:
        raise malformed
    dotted, raw = item.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if len(keys) < 2 or not all(keys):
        raise malformed
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: name=qwen3
    return keys, value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str) -> None:
    """Apply `section.key=value` strings (values in TOML syntax) onto the parsed tables."""
    for item in overrides:
        keys, value = _parse_override(item)
        table = data
        for key in keys[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(f"'{item}': '{key}' is not a table", source="--set")
        table[keys[-1]] = value


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> Config:
    """Validate parsed tables into a Config (no world-size check: see `check_world_size`)."""
    for section in data:
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}]{did_you_mean(section, SECTIONS)}; "
                f"allowed sections: {', '.join(SECTIONS)}",
                source=source,
            )
        if not isinstance(data[section], dict):
            raise ConfigError(f"[{section}] must be a table", source=source)
    loss_table = dict(data.get("loss", {}))
    loss_name = loss_table.pop("name", "grpo")
    tables = {k: v for k, v in data.items() if k != "loss"}
    tables["loss"] = {"name": loss_name, "kwargs": loss_table}
    config = build_dataclass(Config, tables, path=(), source=source)
    config.source = source
    if config.model.hf_checkpoint == "":  # lets `--set model.hf_checkpoint=""` mean "none"
        config.model.hf_checkpoint = None
    _check_cross_fields(config)
    return config


def _check_cross_fields(config: Config) -> None:
    from titan_learner.losses import check_loss_kwargs

    source = config.source
    p = config.parallelism
    if config.compile.enable and p.tp > 1 and config.activation_checkpoint.mode != "none":
        raise ConfigError(
            "compile with tensor parallel and activation checkpointing together fails in "
            "torch 2.13; allowed: any two of them",
            source=source,
            where="[compile] enable",
        )
    check_loss_kwargs(config.loss, source)


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


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a TOML file into a typed Config."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("file not found", source=source) from None
    except OSError as err:
        raise ConfigError(f"cannot read file: {err.strerror}", source=source) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}", source=source) from None
    apply_overrides(data, overrides or [], source)
    return config_from_dict(data, source)


# -- the resolved config as TOML ------------------------------------------------------------------

RESOLVED_CONFIG = "config.toml"
"""The file a checkpoint root holds: the config that trained it, so an export needs no other."""

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def config_to_toml(config: Config) -> str:
    """The config as TOML that `load_config` reads back to an equal Config (`source` aside).

    One table per section in schema order, then its sub-tables; `[loss]` holds `name` and the
    loss keyword arguments as plain keys, as a user writes them. TOML has no null: a None is left
    out, which reads back as the field's default, so a None whose default is not None (set from
    Python) raises ValueError instead of changing meaning.
    """
    tables = []
    for name in SECTIONS:
        section = getattr(config, name)
        if name == "loss":
            table = {"name": section.name, **_plain(section.kwargs, ("loss",))}
        else:
            table = _plain(section, (name,))
        tables.append(_toml_table(name, table))
    return "\n".join(tables)


def save_resolved_config(config: Config, directory: str | os.PathLike) -> Path:
    """Write `config_to_toml(config)` to `directory/config.toml` atomically; return its path.

    A reader sees the previous file or the new one, whole (temp file, fsync, os.replace).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = _toml_string(config.source)  # one line, whatever the path holds
    text = f"# The resolved config of this run (from {source}); read by `export`.\n"
    text += config_to_toml(config) + "\n"
    final = directory / RESOLVED_CONFIG
    tmp = directory / f".{RESOLVED_CONFIG}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


_NO_DEFAULT = object()


def _plain(obj: Any, path: tuple[str, ...]) -> dict[str, Any]:
    """A section (dataclass) or table (dict) as a dict of TOML-representable values."""
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name), _default(f)) for f in dataclasses.fields(obj)]
    else:
        items = [(key, value, _NO_DEFAULT) for key, value in obj.items()]
    out: dict[str, Any] = {}
    for key, value, default in items:
        where = (*path, key)
        if value is None:
            if default is None:  # left out, it reads back as the default: None
                continue
            meaning = "drop the key" if default is _NO_DEFAULT else f"mean {default!r}"
            raise ValueError(
                f"{_location(where)} = None has no TOML form (TOML has no null) and leaving "
                f"it out would {meaning}; set a value instead"
            )
        if dataclasses.is_dataclass(value) or isinstance(value, dict):
            out[key] = _plain(value, where)
        else:
            out[key] = _plain_value(value, where)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def _plain_value(value: Any, where: tuple[str, ...]) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain_value(v, where) for v in value]
    if isinstance(value, dict):
        return _plain(value, where)
    if value is None or not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{_location(where)}: {value!r} has no TOML form")
    return value


def _location(path: tuple[str, ...]) -> str:
    return f"[{'.'.join(path[:-1])}] {path[-1]}"


def _toml_table(name: str, table: dict[str, Any], prefix: str = "") -> str:
    header = f"[{prefix}{_toml_key(name)}]"
    scalars, subtables = [], []
    for key, value in table.items():
        if isinstance(value, dict):
            subtables.append(_toml_table(key, value, prefix=f"{prefix}{_toml_key(name)}."))
        else:
            scalars.append(f"{_toml_key(key)} = {_toml_value(value)}")
    return "\n".join([header, *scalars, *subtables])


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)  # ints; floats as 1e-05, 0.9, inf, -inf, nan: all TOML
