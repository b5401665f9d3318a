"""`[checkpoint] export_hf = true`: beside each saved step, `step-<N>/hf`, the directory
`titan-learner export` writes (weights, config, the run's tokenizer and generation config).

Rank 0 runs the export as a `titan-learner export` process of its own, once the step is
committed: it reads the step from disk, so it never touches the training process's model, RNG
streams (the export builds a model, which draws random numbers) or process group, and takes no
GIL from the training loop. With `async_save` it starts when the background save commits and
runs alongside training; otherwise the step waits for it. The next save waits for the export in
flight first (rotation may remove an older step's directory), and so does the end of the run.

A failed export is a warning, not a stop: the checkpoint itself is committed, and can be
exported later by hand. Cost: the export process holds the model in fp32 on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from titan_learner.checkpoint.async_save import SaveHandle
from titan_learner.checkpoint.layout import METADATA, step_dir

HF_DIR = "hf"
POLL_S = 0.1
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class HFExports:
    """Rank 0's exports of saved steps, one in flight at a time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._thread: threading.Thread | None = None

    def after_save(self, handle: SaveHandle, step: int, asynchronous: bool) -> None:
        """Export `step` once its save commits: in the background when the save is."""
        self.wait()
        self._thread = threading.Thread(
            target=self._export, args=(handle, step), name=f"export-step-{step}", daemon=True
        )
        self._thread.start()
        if not asynchronous:
            self.wait()

    def wait(self) -> None:
        """Until the export in flight (if any) has finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _export(self, handle: SaveHandle, step: int) -> None:
        while not handle.done():  # rank 0's part includes the commit
            time.sleep(POLL_S)
        saved = step_dir(self.root, step)
        if not (saved / METADATA).is_file():
            return  # the save failed: `handle.wait()` says why, on every rank
        command = [
            sys.executable, "-m", "titan_learner", "export",
            "--checkpoint", str(self.root), "--step", str(step), "--out", str(saved / HF_DIR),
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if key not in TORCHRUN_ENV}
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            lines = (result.stderr or result.stdout).strip().splitlines()
            warnings.warn(
                f"export of step {step} to {saved / HF_DIR} failed "
                f"({lines[-1] if lines else f'exit code {result.returncode}'}); the checkpoint "
                f"is intact: titan-learner export --checkpoint {self.root} --step {step}",
                stacklevel=1,
            )
