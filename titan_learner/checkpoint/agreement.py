"""Checkpoint collectives that fail instead of hanging, and one outcome for every rank.

Checkpoint collectives run on their own gloo group with a timeout, so a rank that never joins a
save ends the job with an error naming the operation; one rank's failure is raised on every
rank, so no rank walks on into the next collective alone.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_learner.checkpoint.errors import CheckpointError, CheckpointTimeoutError
from titan_learner.ranks import is_distributed, rank, world_size

T = TypeVar("T")
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"

_GROUPS: dict[tuple[int, float], dist.ProcessGroup] = {}


def checkpoint_group(timeout: float) -> dist.ProcessGroup | None:
    """A gloo group over every rank whose collectives fail after `timeout` seconds.

    Checkpoint collectives get their own group so that a rank that never joins a save ends the
    job with an error naming the operation instead of hanging on the training group's timeout;
    gloo also lets `dcp.async_save` run its collectives from a background thread, on CUDA jobs
    too. Created on first use (a collective over the world): every rank must pass the same
    timeout. None (no collectives at all) without a process group, or in a world of one.
    """
    if not is_distributed() or world_size() == 1:
        return None
    key = (id(dist.group.WORLD), float(timeout))
    if key not in _GROUPS:
        try:
            _GROUPS[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except Exception as err:
            raise CheckpointTimeoutError(
                f"creating the checkpoint process group (gloo, timeout {timeout:g} s) failed: "
                f"{first_line(err)}. Not every rank called save()/load() (collectives), or "
                "not with the same timeout"
            ) from err
    return _GROUPS[key]


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def join(group: dist.ProcessGroup | None, timeout: float, operation: str) -> None:
    """Every rank enters `operation`, or rank 0 names the ones that did not, after `timeout`."""
    if group is None:
        return
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        raise CheckpointTimeoutError(
            f"{operation}: not every rank joined within {timeout:g} s ({first_line(err)}). "
            "save() and load() are collectives: every rank must call them, in the same order"
        ) from err


def agree(group: dist.ProcessGroup | None, operation: str, error: BaseException | None) -> None:
    """One rank's failure becomes every rank's failure, so no rank walks on into a collective."""
    if group is None:
        if error is not None:
            raise error
        return
    reports: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(reports, mine, group=group)
    except RuntimeError as err:
        raise CheckpointTimeoutError(
            f"{operation}: ranks could not agree on the outcome ({first_line(err)})"
        ) from err
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        rank, report = failed[0]
        raise CheckpointError(f"{operation} failed on rank {rank}: {report}")


def same_error(group: dist.ProcessGroup | None, error: CheckpointError | None) -> None:
    """Raise the lowest failing rank's CheckpointError on every rank, its message unchanged
    (a damaged record names its own file), or nothing when no rank failed."""
    if group is None:
        if error is not None:
            raise error
        return
    reports: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else str(error), group=group)
    failed = [report for report in reports if report is not None]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(failed[0])


def everywhere(group: dist.ProcessGroup | None, operation: str, fn: Callable[[], T]) -> T:
    """Run `fn` on this rank; raise on every rank if it raised on any."""
    try:
        result, error = fn(), None
    except Exception as err:
        result, error = None, err
    agree(group, operation, error)
    return result  # type: ignore[return-value]


def on_rank0(group: dist.ProcessGroup | None, operation: str, fn: Callable[[], T]) -> T | None:
    return everywhere(group, operation, fn if rank() == 0 else lambda: None)


def dcp_error(operation: str, err: BaseException) -> CheckpointError:
    """DCP gathers every rank's exception into one CheckpointException: name rank and cause."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, CheckpointException) and err.failures:
        cause, _trace = err.failures[min(err.failures)]
        if isinstance(cause, CheckpointError):
            return CheckpointError(f"{operation}: {cause}")
        where = f"rank(s) {sorted(err.failures)}"
        err = cause
    else:
        where = f"rank {rank()}"
    return CheckpointError(
        f"{operation} failed on {where}: {type(err).__name__}: {first_line(err)} (for a load: "
        "a shard file may be corrupted; for a save: check the disk and that every rank can write)"
    )


@contextlib.contextmanager
def dcp_call(operation: str, no_dist: bool) -> Iterator[None]:
    """Translate DCP's errors; silence its 'single process' warning when that is the intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        try:
            yield
        except (Exception, CheckpointException) as err:
            raise dcp_error(operation, err) from err
