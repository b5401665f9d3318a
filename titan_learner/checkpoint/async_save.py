"""A save in flight: the handle every rank waits on, and the commit that follows the upload."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_learner.checkpoint.agreement import agree, dcp_error
from titan_learner.checkpoint.errors import CheckpointError

_PENDING: SaveHandle | None = None


class SaveHandle:
    """A save in flight (asynchronous) or done (synchronous): `wait()` returns the committed path.

    `wait()` is a collective: every rank calls it. It returns once rank 0 has renamed the step
    directory and moved `latest`, and raises on every rank if the save failed on any.
    """

    def __init__(
        self,
        path: Path,
        operation: str,
        group: dist.ProcessGroup | None = None,
        future: Future | None = None,
    ) -> None:
        self.path = path
        self._operation = operation
        self._group = group
        self._future = future
        self._settled = future
        """Kept after `wait()` takes `_future`: `done()` must not say True while `wait()` still
        blocks on it (rank 0's HF export thread would read a step not yet committed)."""
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether this rank's part (on rank 0: the commit too) has finished; never blocks."""
        return self._settled is None or self._settled.done()

    def wait(self) -> Path:
        global _PENDING
        if self._future is not None:
            future, self._future = self._future, None
            if _PENDING is self:
                _PENDING = None
            error = None
            try:
                future.result()
            except (Exception, CheckpointException) as err:
                error = dcp_error(self._operation, err)
            try:
                agree(self._group, self._operation, error)
            except CheckpointError as err:
                self._error = err
        if self._error is not None:
            raise self._error
        return self.path


def set_pending(handle: SaveHandle) -> None:
    """Remember the asynchronous save now in flight (one at a time)."""
    global _PENDING
    _PENDING = handle


def wait_for_pending_save() -> None:
    """Finish the asynchronous save still in flight, if any (a collective, like `wait()`).

    Called by `save` and `load` first: DCP's collectives of two saves must not interleave on
    the checkpoint group.
    """
    if _PENDING is not None:
        _PENDING.wait()


def then_commit(upload: Future, commit: Callable[[], Path], discard: Callable[[], None]) -> Future:
    """A future that completes after `upload` and then `commit` (rank 0's async save). A failed
    upload calls `discard` first (every rank's write has ended by then: DCP gathers their
    results before the upload's future completes), so a full disk is freed at once."""
    done: Future = Future()

    def on_upload(future: Future) -> None:
        try:
            future.result()
        except BaseException as err:  # CheckpointException is a BaseException
            discard()
            done.set_exception(err)
            return
        try:
            done.set_result(commit())
        except BaseException as err:
            done.set_exception(err)

    upload.add_done_callback(on_upload)
    return done


class AlreadyStaged:
    """An AsyncStager that stages nothing: `Learner.checkpoint()` already returned CPU clones."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def on_cpu(state: dict[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    def tensors(value: Any) -> Iterator[torch.Tensor]:
        if isinstance(value, dict):
            for item in value.values():
                yield from tensors(item)
        elif isinstance(value, torch.Tensor):
            yield value.to_local() if isinstance(value, DTensor) else value

    return all(t.device.type == "cpu" for t in tensors(state))
