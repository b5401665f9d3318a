"""Spawn real gloo worlds for tests: N processes, each running `fn(rank, *args)`.

A world costs seconds to start on 2 cores, so tests run many checks inside one world and hand
the results back to the pytest process, which compares them with a one-process reference.
"""

from __future__ import annotations

import io
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.support.servers import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        # Bytes, not tensors: torch's queue pickling shares tensor memory that dies with us.
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world_size: int, fn: Callable, *args: Any, timeout: float = 900) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` spawned processes; return the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = results.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except queue.Empty:
        errors.append(f"world of {world_size} timed out after {timeout} s")
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else 60)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [collected[r] for r in range(world_size)]
