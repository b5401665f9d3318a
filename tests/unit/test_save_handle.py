"""A save handle says it is done only once its save is: while the main thread waits on it at the
end of a run, rank 0's HF export thread polls `done()` and must not read an uncommitted step
(seen in CI under load: `[checkpoint] export_hf` left the last step without its `hf/`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from titan_learner.checkpoint.async_save import SaveHandle
from titan_learner.model.parallelize import init_process_group


def test_done_stays_false_while_wait_blocks_on_the_commit(tmp_path: Path):
    init_process_group("cpu")
    try:
        commit: Future = Future()
        handle = SaveHandle(tmp_path / "step-2", "save", future=commit)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive(), "wait() returned before its commit"
        assert not handle.done()
        commit.set_result(tmp_path / "step-2")
        waiter.join(timeout=30)
        assert not waiter.is_alive() and handle.done()
    finally:
        dist.destroy_process_group()
