"""The architecture of a learner's model, recorded beside its checkpoints.

A run started from `[model] hf_checkpoint` takes its shape from that directory's config.json;
the checkpoint then only means something with that directory at hand. The learner writes the
transformers config of the model it built (`hf_config(spec)`, the inverse of
`read_architecture`) next to the steps, so an export rebuilds the same model once the base
directory has moved or is on another machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from titan_learner.files import atomic_write_text
from titan_learner.model.hf_architecture import HFArchitecture, read_architecture

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

ARCHITECTURE_FILE = "model_config.json"


def record_architecture(spec: ModelSpec, directory: str | os.PathLike) -> Path:
    """Write the transformers config of `spec` to `directory/model_config.json` (atomically)."""
    from titan_learner.model.hf_config import hf_config

    text = hf_config(spec).to_json_string(use_diff=False)
    return atomic_write_text(Path(directory) / ARCHITECTURE_FILE, text)


def recorded_architecture(directory: str | os.PathLike, source: str) -> HFArchitecture | None:
    """The architecture recorded in `directory`, or None when none was."""
    return read_architecture(str(directory), source, ARCHITECTURE_FILE)
