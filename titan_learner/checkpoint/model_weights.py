"""The model's weights alone, out of a learner checkpoint: what export reads, and the shapes a
resume is checked against before any model is built.

A learner checkpoint also holds optimizer moments, the LR schedule and counters; none of them
say anything about the weights, and restoring them needs a learner whose config fits them (its
optimizer, its `run.steps`). Reading only the `model.*` records needs the model alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titan_learner.checkpoint.agreement import dcp_call
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.safe_read import SafeLoadPlanner, SafeReader, open_step
from titan_learner.model.lora import checkpointed_state, load_checkpointed_state

MODEL_KEY = "model"


def saved_model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor the checkpoint holds, by state-dict name."""
    prefix = f"{MODEL_KEY}."
    return {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def model_mismatch(saved: dict[str, tuple[int, ...]], here: dict[str, tuple[int, ...]]) -> str:
    """What differs between two models' shapes ('' when they are the same model), in a few words."""
    parts = []
    differing = [
        f"{k} (shape {saved[k]} saved, {here[k]} here)"
        for k in here
        if k in saved and saved[k] != here[k]
    ]
    for title, items in (
        ("mismatched", differing),
        ("missing from the checkpoint", sorted(k for k in here if k not in saved)),
        ("only in the checkpoint", sorted(k for k in saved if k not in here)),
    ):
        if items:
            more = f", ... ({len(items) - 3} more)" if len(items) > 3 else ""
            parts.append(f"{len(items)} {title}: {', '.join(items[:3])}{more}")
    return "; ".join(parts)


def load_model_weights(
    model: nn.Module, directory: str | os.PathLike, step: int | None = None
) -> Path:
    """Fill a plain (unsharded) `model` with the weights of the checkpoint `latest` names (or
    `step`) in `directory`; return the step directory. One process, no process group.

    Shapes are compared before any record is read: another model ends in one CheckpointError
    naming the differing tensors. Records are checksum-verified as in a full load.
    """
    path, metadata, checksums = open_step(Path(directory), step)
    state = checkpointed_state(model)  # with LoRA the adapters alone, on the base already in
    mismatch = model_mismatch(
        saved_model_shapes(metadata), {k: tuple(v.shape) for k, v in state.items()}
    )
    if mismatch:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model (another model config?): {mismatch}"
        )
    with torch.no_grad(), dcp_call(f"checkpoint load of {path}", no_dist=True):
        dcp.load(
            {MODEL_KEY: state},
            storage_reader=SafeReader(path, metadata, checksums, None),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
        load_checkpointed_state(model, state)
    return path
