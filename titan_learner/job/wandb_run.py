"""`[logging] wandb`: the run's record in Weights & Biases too, from rank 0.

Every record of metrics.jsonl is logged as it is, under the same names (`training/<name>`,
`eval/<name>`) and with its `step` as the charts' x-axis (`define_metric`): W&B's own step only
grows, and a resumed run logs again the steps after its checkpoint. The resolved config is the
run's config; each evaluation's completions are a table (prompt, completion, reward); the curves
figure is logged at the end.

A resumed run continues the same W&B run: its id is kept in `<output_dir>/wandb_run_id` (a fresh
run in the same directory, after `--overwrite` moved the old one aside, gets a new id).
`mode = "offline"` writes under `<output_dir>/wandb` for `wandb sync` later.
"""

from __future__ import annotations

import importlib.util
import secrets
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.config.tables import as_plain_dict
from titan_learner.files import atomic_write_text

RUN_ID_FILE = "wandb_run_id"
STEP = "step"
INSTALL = 'pip install "titan_learner[wandb]"'


def require_wandb(config: Config) -> None:
    """ConfigError (one line, naming the extra) when [logging] wandb is set and the package is
    missing; checked with the job's inputs, before any compute."""
    section = config.logging.wandb
    if section is None or section.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"the wandb package is not installed; allowed: {INSTALL}, or no [logging] wandb",
            source=config.source,
            where="[logging] wandb",
        )


def start_wandb(config: Config, output_dir: Path, resume: bool, quiet: bool) -> WandbRun | None:
    """The run's W&B run (None without [logging] wandb, or with mode = "disabled");
    ConfigError (one line) when W&B refuses to start it (online without a login, say)."""
    section = config.logging.wandb
    if section is None or section.mode == "disabled":
        return None
    try:
        return WandbRun(config, output_dir, resume=resume, quiet=quiet)
    except Exception as err:  # W&B's own errors (UsageError, CommError) share no base class
        text = str(err).strip()
        first = text.splitlines()[0].rstrip(".") if text else type(err).__name__
        raise ConfigError(
            f"cannot start the W&B run: {first}; allowed: `wandb login` (or WANDB_API_KEY) "
            'for mode = "online", or mode = "offline"',
            source=config.source,
            where="[logging] wandb",
        ) from err


class WandbRun:
    """One run's W&B logging, on rank 0."""

    def __init__(self, config: Config, output_dir: Path, *, resume: bool, quiet: bool) -> None:
        import wandb

        section = config.logging.wandb
        id_file = output_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        if run_id is None:
            run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f], as W&B's own ids
            output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(id_file, run_id + "\n")
        self._wandb = wandb
        self.run = wandb.init(
            project=section.project,
            entity=section.entity,
            mode=section.mode,
            name=section.name,
            tags=section.tags or None,
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            config=as_plain_dict(config),
            settings=wandb.Settings(silent=quiet, console="off"),
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def log(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: {"step": N, "<namespace>/<name>": value, ...}."""
        self.run.log(record)

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """An evaluation's completions as a table: one row per (prompt, completion, reward)."""
        table = self._wandb.Table(columns=["prompt", "completion", "reward"])
        for row in rows:
            for completion, reward in zip(row["completions"], row["rewards"], strict=True):
                table.add_data(row["prompt"], completion, reward)
        self.run.log({STEP: step, "eval/completions": table})

    def finish(self, curves: Path | None) -> None:
        if curves is not None:
            self.run.log({"curves": self._wandb.Image(str(curves))})
        self.run.finish()
