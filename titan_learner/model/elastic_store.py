"""A process group on a store of our own: a restarted torchrun worker group in a key space of
its own, and a world of one without a launcher on a port no other process can take first.

torchrun (torch 2.13) shares its rendezvous store with the workers it starts
(`TORCHELASTIC_USE_AGENT_STORE=True`) and keeps it across the restarts of `--max-restarts`, but
`init_process_group` writes its keys there without a per-restart prefix: a restarted group
reads the addresses the previous, dead group published and fails to connect ("Connection
refused"; pytorch/pytorch#135712). One prefix per restart count keeps the groups apart.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_learner.model import platform


def restarted_group_store(timeout: timedelta) -> dist.Store | None:
    """The agent's store under `titan_learner/restart-<n>/` for restart n > 0, else None (the
    first launch, or a launcher that shares no store, needs nothing)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not restarts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return dist.PrefixStore(f"titan_learner/restart-{restarts}/", launcher_store(timeout))


def launcher_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the launcher's store (MASTER_ADDR:MASTER_PORT) on a connection of its own:
    under torchrun, the agent's store, which outlives the workers and their groups. For what
    the ranks must tell each other outside a collective (a rollout thread, a failing rank)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )


def single_process_store(timeout: timedelta) -> dist.Store:
    """The store of a world of one that no launcher set up, on a port the OS picks as it binds
    it: a port probed first and bound later can be taken in between by another process (seen
    in CI: EADDRINUSE). Its port goes to MASTER_PORT for whoever reads it."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    platform.mark_own_world()
    return store


def init_group_on_store(device_type: str, store: dist.Store, timeout: timedelta) -> None:
    """What TorchTitan's `init_distributed` does, on `store`: autograd without worker threads
    (its AC and DTensor code read the device mesh from thread-local state), then the default
    group with the device's backend (gloo on CPU, NCCL on CUDA). The NCCL flight-recorder
    variables it also sets keep torchrun's values: they only shape debugging dumps."""
    torch.autograd.set_multithreading_enabled(False)
    dist.init_process_group(
        backend=dist.Backend.default_device_backend_map[device_type],
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
