"""The model a vLLM engine starts from, for any run, including one that has no model directory.

A run that starts from `[model] hf_checkpoint` (or names `[rollout] model_path`) serves that
directory. A run that builds its model from scratch (`[model] flavor` and overrides: the
embedded default) has no directory at all, yet its engines, colocated or servers, only ever
sample with the learner's weights: the job pushes them before the first rollout. Such an engine
starts from a directory holding the learner's config.json alone, with vLLM's dummy weights
(`load_format = "dummy"`: placeholder values, no file read), which the first push replaces.

The directory is a cache keyed by the config's content (under $XDG_CACHE_HOME, else
~/.cache), so every rank, every server on a node and every restart share one, and a server
on another node writes its own from the same run config.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from titan_learner.config.derived import engine_model_path
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config

DUMMY = "dummy"
"""vLLM's load format that reads no weight file (`vllm.config.LoadFormat`)."""
JOB_REMEDY = 'generator = "hf", or rollout servers on GPUs'
"""What else a job whose engines' head width vLLM's CPU attention cannot take may do."""
SERVER_REMEDY = "or a server on GPUs"
"""The same for a server on CPU: its config's generator is already "vllm"."""


def engine_model(config: Config) -> tuple[str, dict[str, Any]]:
    """The engines' model directory and the engine arguments it needs: the run's HF directory
    as it is, or, for a model built from scratch, the learner's config.json with dummy weights."""
    if (path := engine_model_path(config)) is not None:
        return path, {}
    from titan_learner.model.hf_config import learner_hf_config

    return str(config_only_directory(learner_hf_config(config).to_dict())), {"load_format": DUMMY}


def check_cpu_head_dim(config: Config, remedy: str = JOB_REMEDY) -> None:
    """An engine on this machine's CPU: vLLM's CPU attention takes a few head widths and fails
    on any other at the first rollout, with a worker traceback (head_dim 16: the embedded
    default's). `remedy`: what else the caller allows (a server cannot change generator)."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return  # no vllm here: the engine arguments' check says so
    from titan_learner.model.hf_config import learner_hf_config

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    head_dim = learner_hf_config(config).head_dim
    if head_dim not in sizes:
        raise ConfigError(
            f"vLLM's CPU attention takes head_dim {', '.join(map(str, sizes))} and this model's "
            f"is {head_dim}; allowed: a model with one of them ([model.overrides] dim / n_heads, "
            f"or head_dim for qwen3), {remedy}",
            source=config.source,
            where="[rollout] generator",
        )


def config_only_directory(hf_config: dict[str, Any], cache: Path | None = None) -> Path:
    """A directory holding `hf_config` as its config.json (nothing else), written once per
    content and atomically, so processes that start together read a whole file."""
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = (cache or _cache_root()) / "titan_learner" / "engine_models" / digest
    target = directory / "config.json"
    if target.is_file() and target.read_text() == text:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as out:
        out.write(text)
    os.replace(out.name, target)
    return directory


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
