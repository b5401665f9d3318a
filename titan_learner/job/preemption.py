"""SIGTERM (what Slurm and Kubernetes send before they kill a job) ends the run cleanly.

SIGTERM lets the current step finish; the job then writes a checkpoint and exits 0 with one line
saying where. Every SIGTERM after the first is the same request: Slurm signals every process of
a job step and torchrun forwards the signal it gets to its ranks, so under `srun torchrun` each
rank receives two at once, and neither may cost the save. Ctrl-C (SIGINT) stops at once, with the
last checkpoint as it is. Every rank decides together: the request is all-reduced once per step,
so all ranks save the same step even if only one was signalled.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist


class PreemptionGuard:
    """Installs the SIGTERM handler for the duration of a run (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def stop_now(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it each step)."""
        flag = torch.tensor([int(self.requested)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
