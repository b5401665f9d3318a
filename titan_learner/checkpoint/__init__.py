"""DCP checkpoints of a Learner (sharded, atomic, resumable on any layout) and their export to
a Hugging Face directory.

`save`/`load` are collectives; `latest`, `committed_steps`, `resolve` and `read_metadata` only
read the directory. Importing this package imports torch.distributed.checkpoint.
"""

from titan_learner.checkpoint.async_save import SaveHandle, wait_for_pending_save
from titan_learner.checkpoint.errors import CheckpointError, CheckpointTimeoutError
from titan_learner.checkpoint.layout import LATEST, METADATA, committed_steps, latest, resolve
from titan_learner.checkpoint.safe_read import read_metadata
from titan_learner.checkpoint.save_load import DEFAULT_TIMEOUT_S, Checkpointable, load, save

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LATEST",
    "METADATA",
    "CheckpointError",
    "CheckpointTimeoutError",
    "Checkpointable",
    "SaveHandle",
    "committed_steps",
    "latest",
    "load",
    "read_metadata",
    "resolve",
    "save",
    "wait_for_pending_save",
]
