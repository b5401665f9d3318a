"""Which base a LoRA run's adapters were trained on, recorded beside its checkpoints.

A LoRA checkpoint holds the adapters, not the frozen base they adapt (the run's `[model]
hf_checkpoint`, or its seeded init): it means something only on that same base. The learner
writes the base's fingerprint (an xxh3 of its weights, model.lora.base_fingerprint) next to
the steps, and every load of the adapters (resume, `Learner.load`, export) compares it with
the base at hand before reading a record, so adapters never land on another model silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.files import atomic_write_text

BASE_FILE = "lora_base.json"


def record_base(directory: str | os.PathLike, fingerprint: str, base: str | None) -> Path:
    """Write `directory/lora_base.json`: the fingerprint and where the base was read from."""
    text = json.dumps({"fingerprint": fingerprint, "hf_checkpoint": base}, indent=2)
    return atomic_write_text(Path(directory) / BASE_FILE, text + "\n")


def check_base(directory: str | os.PathLike, fingerprint: str, base: str | None) -> None:
    """CheckpointError (one line) unless the checkpoints in `directory` (a root, or a step
    directory of one) record the base whose fingerprint is `fingerprint`."""
    directory = Path(directory)
    record = next(
        (d / BASE_FILE for d in (directory, directory.parent) if (d / BASE_FILE).is_file()), None
    )
    here = base or "the seeded initial weights"
    if record is None:
        raise CheckpointError(
            f"checkpoint {directory} has no {BASE_FILE}, which says which base model its LoRA "
            f"adapters were trained on; allowed: a checkpoint a LoRA run saved (it writes one)"
        )
    saved = json.loads(record.read_text())
    if saved.get("fingerprint") != fingerprint:
        trained_on = saved.get("hf_checkpoint") or "seeded initial weights"
        raise CheckpointError(
            f"checkpoint {directory} holds LoRA adapters trained on another base model "
            f"({trained_on}, fingerprint {saved.get('fingerprint')}); this run's base is {here} "
            f"(fingerprint {fingerprint}); allowed: the same [model] hf_checkpoint weights, or a "
            "new output_dir"
        )
