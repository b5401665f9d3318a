"""The accommodations TorchTitan 0.3.0 needs off its home turf (CPU, gloo), in one place.

Each function names one problem measured on this stack (see shared NOTES) and fixes it at the
smallest scope; on CUDA/NCCL every function here is a no-op, so there is one code path.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import nn

# Modules that copy torchtitan.tools.utils.device_type/device_module by name at import time.
_DEVICE_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
)


def set_titan_device_type(device_type: str) -> None:
    """TorchTitan falls back to 'cuda' on a machine with no accelerator; tell it the truth.

    Must run before `init_distributed`, which picks the process-group backend from it (gloo on CPU).
    """
    module = torch.cuda if device_type == "cuda" else torch.cpu
    for name in _DEVICE_COPIES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = device_type
        if hasattr(mod, "device_module"):
            mod.device_module = module


def force_sum_reduction_on_gloo(model: nn.Module) -> None:
    """gloo has no PREMUL_SUM: make every FSDP module reduce with SUM (then divide) instead."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


OWN_WORLD = "TITAN_LEARNER_OWN_WORLD"
"""Holds the launcher variables' values this process set itself for a world of one. A later run
in this process, or a child it starts outside a launcher, that still sees those same values
forms a new world of one instead of joining the store of one that is gone; a process whose
variables someone else rewrote since (torchrun, `torch.multiprocessing` workers that inherit
the marker) joins the world they describe."""


def _world_fingerprint() -> str:
    return "/".join(os.environ.get(name, "") for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))


def mark_own_world() -> None:
    """Record the launcher variables as this process's own world of one (call once MASTER_PORT
    is set)."""
    os.environ[OWN_WORLD] = _world_fingerprint()


def default_single_process_env() -> bool:
    """Let a plain `python -m ...` (no torchrun) be rank 0 of a world of one; True when it set
    that up (the caller then opens the world's store itself, on a port the OS picks)."""
    ours = (
        os.environ.get(OWN_WORLD) == _world_fingerprint()
        and "TORCHELASTIC_RUN_ID" not in os.environ
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not ours:
        return False
    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    return True
