"""`python -m titan_learner export`: a DCP checkpoint as a Hugging Face model directory that
serves as it is (`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(d)`, `vllm serve d`).

    python -m titan_learner export --checkpoint DIR --out HF_DIR [--dtype bf16] [--config FILE]
                                   [--step N] [--max-shard-size 5GB]

The run's model is rebuilt on CPU, plain and unsharded, and only its weights are read from the
checkpoint (DCP reshards whatever layout saved them; optimizer moments, the LR schedule and the
run's length play no part). Its weights leave under Hugging Face names (TorchTitan's state-dict
adapter: llama3's rotary permutation), and a transformers model built from `hf_config(spec)`
takes them strictly and writes `save_pretrained`: safetensors (sharded with an index above
`max_shard_size`), config.json and generation_config.json. transformers then loads the
directory with the logits the learner computes.

What else a server needs goes along (`data.serving_files`): the run's tokenizer and the chat
template it trained with, and a generation config with the EOS ids its rollouts stopped on;
from the record the GRPO job keeps beside its checkpoints (`<root>/tokenizer`), else from the
config's `[tokenizer]` / `[model] hf_checkpoint` where that directory is here. A run with no
tokenizer at all exports no token ids (the checkpoint does not know them). The fields of
`hf_checkpoint`'s config.json that the learner does not change (architectures, rope scaling,
model-specific keys) stay, `torch_dtype` set to the export dtype.

Which model a checkpoint holds comes from `<checkpoint root>/config.toml` (written next to the
checkpoints by `Learner.save`), or from `--config`. A run from `hf_checkpoint` takes its shape
from that directory's config.json; where that directory is gone, from the architecture the
learner recorded beside the checkpoints (`model_config.json`).

Nothing half-written is left behind: the files go to a hidden sibling directory that is renamed
to the output directory only once complete; an existing non-empty output directory is refused.

Cost: the model (fp32) in CPU memory, plus one copy of the exported weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.layout import checkpoint_root, resolve
from titan_learner.checkpoint.lora_base import check_base
from titan_learner.checkpoint.model_weights import load_model_weights
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config, ModelOverrides
from titan_learner.config.toml import RESOLVED_CONFIG, load_config
from titan_learner.data.serving_files import (
    GENERATION_CONFIG,
    TOKENIZER_RECORD,
    write_serving_files,
)
from titan_learner.data.tokenizer import load_tokenizer, tokenizer_dir
from titan_learner.dtypes import dtype_name, parse_dtype
from titan_learner.model.architecture_record import ARCHITECTURE_FILE, recorded_architecture
from titan_learner.model.initial_state import full_initial_state, load_full_state, materialize
from titan_learner.model.lora import base_fingerprint
from titan_learner.model.spec import build_meta, model_spec
from titan_learner.weights.export import iter_hf_tensors

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

__all__ = ["ExportError", "export_checkpoint"]

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Above this, the safetensors are split into shards with an index (the Hub's convention)."""
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
ServingFiles = Callable[[Path], None]
"""Writes the run's serving files (tokenizer, chat template, generation config) into a directory."""


class ExportError(RuntimeError):
    """An export that cannot be done as asked: what is wrong and what is allowed."""


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    config: Config | str | os.PathLike | None = None,
    step: int | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the checkpoint as a Hugging Face model directory `out_dir`; return its path.

    checkpoint_dir: a checkpoint root (loads what `latest` names, or `step`) or a step directory.
    dtype: of the written tensors (bf16, fp16, fp32 and their long names); None: the config's
    `[learner] export_dtype`.
    config: a Config or a TOML file; None reads `config.toml` of the checkpoint root.
    max_shard_size: bytes (or "500MB", "5GB") above which the weights are split into shards.
    Raises ConfigError, CheckpointError or ExportError with one clear message on bad input,
    before any output exists. The caller's torch RNG state is left as it was.
    """
    _check_shard_size(max_shard_size)
    out, checkpoint_dir, config, torch_dtype = prepare_export(
        checkpoint_dir, out_dir, dtype, config, step
    )
    root = checkpoint_root(checkpoint_dir)
    serving = _serving(config, root)  # a tokenizer problem: before any work
    with torch.random.fork_rng(devices=[]):
        spec = export_model_spec(config, root)
        model = _plain_model(spec)
        if config.model.lora is not None:
            _load_lora_base(model, spec, config, checkpoint_dir)
        load_model_weights(model, checkpoint_dir, step)
        weights = {name: tensor.to(torch_dtype) for name, tensor in iter_hf_tensors(model, spec)}
        del model
    base = config.model.hf_checkpoint
    base = Path(base) if base and Path(base).is_dir() else None
    with staging(out) as directory:
        _write_hf(spec, weights, torch_dtype, directory, base, serving, max_shard_size)
    return out


def prepare_export(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None,
    config: Config | str | os.PathLike | None,
    step: int | None,
) -> tuple[Path, Path, Config, torch.dtype]:
    """What every export checks before any work (a usable output directory, a committed
    checkpoint, its config): the output and checkpoint paths, the run's config and the dtype
    to write (the config's `[learner] export_dtype` where `dtype` is None)."""
    out = Path(out_dir)
    torch_dtype = parse_dtype(dtype) if dtype is not None else None
    _check_out_dir(out)
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(
            f"checkpoint directory {checkpoint_dir} not found{_why(checkpoint_dir)}"
        )
    resolve(checkpoint_dir, step)  # no checkpoint, an uncommitted one, no metadata: say so now
    config = _resolve_config(checkpoint_dir, config)
    if torch_dtype is None:
        torch_dtype = parse_dtype(config.learner.export_dtype)
    return out, checkpoint_dir, config, torch_dtype


def _check_shard_size(size: int | str) -> None:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        positive = convert_file_size_to_int(size) > 0
    except ValueError:
        positive = False
    if not positive:
        raise ExportError(
            f"--max-shard-size: {size!r} is not a size; allowed: a number of bytes, or a number "
            "with KB, MB, GB (or KiB, MiB, GiB), e.g. 500MB"
        )


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory; allowed: a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(
            f"output directory {out} is not empty; refusing to overwrite it. Allowed: a new or "
            "empty directory"
        )


def _why(checkpoint_dir: Path) -> str:
    """A run's output directory without checkpoints: its config saved none (interval 0, the
    default), which is what a new user who left out [checkpoint] meets at export."""
    if not (checkpoint_dir.parent / "metrics.jsonl").is_file():
        return ""
    return (
        f": the run in {checkpoint_dir.parent} saved no checkpoint ([checkpoint] interval = 0, "
        "the default, saves none); allowed: train with [checkpoint] interval = N (every N "
        "steps) and export its checkpoints/"
    )


def _resolve_config(checkpoint_dir: Path, config: Config | str | os.PathLike | None) -> Config:
    """The given config, else `config.toml` of the checkpoint root (the parent of a step dir)."""
    if isinstance(config, Config):
        return config
    if config is not None:
        return load_config(config)
    candidates = [checkpoint_dir / RESOLVED_CONFIG]
    if checkpoint_root(checkpoint_dir) != checkpoint_dir:
        candidates.append(checkpoint_root(checkpoint_dir) / RESOLVED_CONFIG)
    for path in candidates:
        if path.is_file():
            return load_config(path)
    raise ExportError(
        f"no config for checkpoint {checkpoint_dir}: {' or '.join(map(str, candidates))} not "
        "found (it says which model the checkpoint holds; Learner.save writes it); allowed: "
        "pass --config FILE, the TOML file the run was trained with"
    )


def export_model_spec(config: Config, root: Path) -> ModelSpec:
    """The spec of the run's model: the config's, with `hf_checkpoint`'s architecture where
    that directory is here, else the one recorded in the checkpoint root."""
    section = config.model
    base = section.hf_checkpoint
    if not base or (Path(base) / "config.json").is_file():
        return model_spec(section, "sdpa", config.source)
    arch = recorded_architecture(root, config.source)
    if arch is None:
        raise ExportError(
            f"the run's model directory {base} ([model] hf_checkpoint) has no config.json here "
            f"and {root / ARCHITECTURE_FILE} is missing; allowed: export where that directory "
            "is, or pass --config FILE with hf_checkpoint naming a copy of it"
        )
    section = dataclasses.replace(section, hf_checkpoint=None, overrides=ModelOverrides())
    return model_spec(section, "sdpa", config.source, arch)


def _plain_model(spec: ModelSpec) -> torch.nn.Module:
    """The spec's model on CPU, unsharded; its own init fills the buffers (RoPE tables)."""
    model = build_meta(spec)
    materialize(model, torch.device("cpu"))
    return model


def _load_lora_base(
    model: torch.nn.Module, spec: ModelSpec, config: Config, checkpoint_dir: Path
) -> None:
    """A LoRA checkpoint holds the adapters alone: the base they adapt is the run's initial
    weights, read again and checked against the fingerprint the run recorded."""
    base = config.model.hf_checkpoint
    if base and not Path(base).is_dir():
        raise ExportError(
            f"the checkpoint holds LoRA adapters, not the base model they adapt ([model] "
            f"hf_checkpoint {base}, not found here); allowed: export where that directory is, "
            "or pass --config FILE with hf_checkpoint naming a copy of it"
        )
    full = full_initial_state(spec, config.model, config.run.seed, config.source)
    check_base(checkpoint_dir, base_fingerprint(full), base)
    load_full_state(model, full)


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A hidden sibling directory, renamed onto `out` when the block succeeds, removed if not."""
    staging = out.parent / f".{out.name}.export-{os.getpid()}.tmp"
    try:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        yield staging
        try:
            os.replace(staging, out)  # onto a missing or empty directory: atomic on POSIX
        except OSError as err:
            raise ExportError(
                f"cannot move the export into {out}: {err.strerror} (it was filled or created "
                "while exporting?); nothing was written there"
            ) from None
    except OSError as err:
        raise ExportError(f"cannot write the export next to {out}: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _serving(config: Config, root: Path) -> ServingFiles | None:
    """The serving files the job recorded beside the checkpoints, else those of the run's
    tokenizer where the config names one that is here, else None (a run without any)."""
    record = root / TOKENIZER_RECORD
    if record.is_dir():
        return lambda directory: shutil.copytree(record, directory, dirs_exist_ok=True)
    try:
        if not tokenizer_dir(config).is_dir():
            return None
    except ConfigError:  # neither [tokenizer] path nor [model] hf_checkpoint
        return None
    tokenizer = load_tokenizer(config)
    return lambda directory: write_serving_files(config, tokenizer, directory)


def _write_hf(
    spec,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    directory: Path,
    base: Path | None,
    serving: ServingFiles | None,
    max_shard_size: int | str,
) -> None:
    """A transformers model of exactly `spec`, loaded strictly with `weights`, saved to disk
    with the run's serving files.

    Built on the meta device (no random init of a second full model) and given the exported
    tensors themselves; non-persistent buffers (RoPE frequencies) stay unallocated, which
    `save_pretrained` never writes. Special token ids come from the base model's config.json,
    else from the run's generation config, else none are claimed (transformers' defaults, e.g.
    Llama's eos 2, would be made up).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from titan_learner.model.hf_config import hf_config

    if serving is not None:
        serving(directory)
    generation = _read_json(directory / GENERATION_CONFIG) if serving is not None else {}
    base_config = _read_json(base / "config.json") if base is not None else {}
    ids = base_config if base_config else generation
    config = hf_config(spec)
    for key in SPECIAL_TOKEN_IDS:
        setattr(config, key, ids.get(key))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(weights, strict=True, assign=True)
    unloaded = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    if unloaded:
        raise ExportError(f"the exported weights left {unloaded[:5]} unset in the HF model")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _keep_base_fields(directory / "config.json", base_config, dtype)
    if generation:  # the run's, which save_pretrained replaced with defaults
        (directory / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _keep_base_fields(path: Path, base_config: dict, dtype: torch.dtype) -> None:
    """config.json as written, over the base model's own fields: what the learner's config does
    not describe (model-specific keys, an older rope_scaling form) stays; the dtype is the
    export's."""
    written = _read_json(path)
    merged = {**base_config, **written}
    merged["dtype"] = merged["torch_dtype"] = dtype_name(dtype)
    path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


def _read_json(path: Path) -> dict:
    """A JSON file of a model directory ({} when there is none)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read {path}: {err}") from None
