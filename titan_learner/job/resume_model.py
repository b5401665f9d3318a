"""A resume refused before any model is built when the checkpoint holds another model.

`check_resume` compares config keys; a model can change without any of them (another
`hf_checkpoint` directory, a checkpoint without its `config.toml`). The checkpoint's metadata
records the global shape of every model tensor: it is compared with the shapes this config
builds on the meta device (no memory, seconds for 8B), so the run stops in one line instead of
after a full build and a failed load.
"""

from __future__ import annotations

from pathlib import Path

from titan_learner.checkpoint.layout import resolve
from titan_learner.checkpoint.model_weights import model_mismatch, saved_model_shapes
from titan_learner.checkpoint.safe_read import read_metadata
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.model.lora import checkpointed_state
from titan_learner.model.spec import build_meta, model_spec
from titan_learner.weights.export import unwrapped_name


def check_resume_model(checkpoints: Path, config: Config) -> None:
    """ConfigError (one line) when the latest checkpoint's model tensors are not the config's."""
    path = resolve(checkpoints)
    saved = {unwrapped_name(k): v for k, v in saved_model_shapes(read_metadata(path)).items()}
    model = build_meta(model_spec(config.model, "sdpa", config.source), config.source)
    here = {name: tuple(tensor.shape) for name, tensor in checkpointed_state(model).items()}
    mismatch = model_mismatch(saved, here)
    if mismatch:
        raise ConfigError(
            f"the checkpoint {path} holds another model than this config builds ({mismatch}); "
            "allowed: the model it was trained with, or a new output_dir",
            source=config.source,
            where="[model]",
        )
