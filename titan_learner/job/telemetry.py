"""Training metrics of a GRPO job: console, JSONL, TensorBoard, W&B and a final plot.

Only rank 0 records anything; the other ranks hold `Telemetry.disabled()`, so the training loop
calls `log` and `close` the same way everywhere. Training metrics are namespaced
`training/<name>`, evaluation metrics `eval/<name>`; `samples` appends a few completions per step
to `samples.jsonl` for people to read. What is printed is `job.console`'s (a progress bar on a
terminal, plain lines in a log); a W&B run (`job.wandb_run`) gets every record too.

`metrics.jsonl` is the durable record: it is flushed after every line, so a crash loses nothing
already logged, and the plot written by `close` is read back from it, so it also covers the steps
of a run this one resumed. A resumed run drops what the previous run logged after its checkpoint
(from the JSONL file, and from TensorBoard through `purge_step`), and a fresh start all of a
killed run's, so no step appears twice, and its `elapsed_s` continues from the last step kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.tensorboard import SummaryWriter

from titan_learner.files import atomic_write_text
from titan_learner.job.console import Console, Verbosity

if TYPE_CHECKING:
    from titan_learner.job.wandb_run import WandbRun

NAMESPACE = "training/"
ELAPSED = "elapsed_s"
"""Seconds of training since the run's first step: a resumed run continues the count."""


class Telemetry:
    """Records per-step metrics of one training run into `output_dir`.

    `start_step` is the last step the run resumes from (0 for a fresh run, which starts the
    JSONL file anew); the first step logged is expected to be `start_step + 1`. `log_every`,
    `verbosity` and `terminal` (None: detected) decide what is printed (`job.console`).
    """

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        *,
        enabled: bool = True,
        start_step: int = 0,
        log_every: int = 1,
        verbosity: Verbosity = "normal",
        terminal: bool | None = None,
        wandb: WandbRun | None = None,
    ) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.samples_path = self.output_dir / "samples.jsonl"
        self._elapsed_before = 0.0
        if start_step > 0:
            _drop_steps_after(self.jsonl_path, start_step)
            _drop_steps_after(self.samples_path, start_step)
            self._elapsed_before = _last_value(self.jsonl_path, NAMESPACE + ELAPSED)
        mode = "a" if start_step > 0 else "w"
        self._jsonl = self.jsonl_path.open(mode)
        self._samples = self.samples_path.open(mode)
        # Hides the events a killed run logged after the step this one starts from (all of
        # them for a fresh start, which logs step 0's evaluation again).
        self._tensorboard = SummaryWriter(
            str(self.output_dir / "tensorboard"),
            purge_step=start_step + 1 if start_step > 0 else 0,
        )
        self._console = Console(
            total_steps,
            start_step=start_step,
            log_every=log_every,
            verbosity=verbosity,
            terminal=terminal,
        )
        self._wandb = wandb

    @classmethod
    def disabled(cls) -> Telemetry:
        """An instance that records nothing, for ranks other than 0."""
        return cls(Path(), 0, enabled=False)

    def log(self, step: int, metrics: dict[str, float], namespace: str = NAMESPACE) -> None:
        """Records one step's metrics (floats or 0-d tensors) everywhere."""
        if not self.enabled:
            return
        values = {name: float(value) for name, value in metrics.items()}
        if namespace == NAMESPACE and ELAPSED in values:  # the run's time, across resumes
            values[ELAPSED] += self._elapsed_before
        record = {"step": step, **{namespace + name: value for name, value in values.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step":
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(record)
        if namespace == NAMESPACE:
            self._console.step(step, values)
        else:
            shown = "  ".join(f"{name}={value:.4g}" for name, value in values.items())
            self._console.event(f"{namespace.rstrip('/')} at step {step}  {shown}")

    def completions(self, step: int, path: Path) -> None:
        """An evaluation's completions (the JSONL file `job.evaluation` wrote) to W&B."""
        if self.enabled and self._wandb is not None:
            self._wandb.completions(step, _read_records(path))

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Appends (prompt, completion, rewards) rows of one step to samples.jsonl."""
        if not self.enabled:
            return
        for row in rows:
            # default=str: a dataset row may hold values JSON has no type for (dates, say)
            self._samples.write(json.dumps({"step": step, **row}, default=str) + "\n")
        self._samples.flush()

    def close(self) -> Path | None:
        """Flushes and closes every output and writes `curves.png`; returns its path."""
        if not self.enabled:
            return None
        self._console.close()
        self._jsonl.close()
        self._samples.close()
        self._tensorboard.close()
        curves = None
        try:
            curves = _plot_curves(_read_records(self.jsonl_path), self.output_dir / "curves.png")
        finally:  # the W&B run ends even when the plot fails (a full disk)
            if self._wandb is not None:
                wandb, self._wandb = self._wandb, None
                wandb.finish(curves)
        return curves


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The JSONL records of `path`, without a last line torn by a crash mid-write."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _last_value(path: Path, key: str) -> float:
    """The last value of `key` in the JSONL file `path` (0.0 when it holds none)."""
    values = [r[key] for r in _read_records(path) if key in r] if path.exists() else []
    return float(values[-1]) if values else 0.0


def _drop_steps_after(path: Path, last_step: int) -> None:
    """Rewrites `path` (atomically) without the records of steps after `last_step`."""
    if not path.exists():
        return
    kept = [record for record in _read_records(path) if record["step"] <= last_step]
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))


Records = list[dict[str, Any]]
Getter = Callable[[dict[str, Any]], "float | None"]


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    points = [(record["step"], record[key]) for record in records if key in record]
    return [step for step, _ in points], [value for _, value in points]


def _band(ax: Any, records: Records, low: Getter, high: Getter, label: str) -> None:
    """A shaded band between `low(record)` and `high(record)` where both are known."""
    rows = [r for r in records if low(r) is not None and high(r) is not None]
    if rows:
        steps = [r["step"] for r in rows]
        ax.fill_between(
            steps, [low(r) for r in rows], [high(r) for r in rows], alpha=0.25, label=label
        )


def _value(key: str) -> Getter:
    return lambda record: record.get(NAMESPACE + key)


def _reward_panel(ax: Any, records: Records) -> None:
    """Mean ± std band, eval reward, pass@1 and pass@k in their own styles, and the reward
    errors (on a right-hand axis) when there were any."""
    ax.plot(*_series(records, NAMESPACE + "reward_mean"), label="mean")
    mean, std = _value("reward_mean"), _value("reward_std")
    _band(
        ax,
        records,
        lambda r: None if std(r) is None else mean(r) - std(r),
        lambda r: None if std(r) is None else mean(r) + std(r),
        "mean ± std",
    )
    for key, label, style in (
        ("eval/reward_mean", "eval reward", "o-"),
        ("eval/pass@1", "eval pass@1", "s--"),
        ("eval/pass@k", "eval pass@k", "^:"),
    ):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, style, label=label)
    steps, errors = _series(records, NAMESPACE + "reward_errors")
    if any(errors):
        twin = ax.twinx()
        twin.plot(steps, errors, color="tab:red", linewidth=0.8, label="reward errors")
        twin.set_ylabel("reward errors", color="tab:red")
    ax.set_title("reward")


def _length_panel(ax: Any, records: Records) -> None:
    """Response length (mean, min..max band) and, on the right, the truncated fraction."""
    ax.plot(*_series(records, NAMESPACE + "response_length_mean"), label="mean")
    _band(ax, records, _value("response_length_min"), _value("response_length_max"), "min..max")
    steps, truncated = _series(records, NAMESPACE + "truncated_fraction")
    if steps:
        twin = ax.twinx()
        twin.plot(steps, truncated, color="tab:red", linewidth=0.8)
        twin.set_ylabel("truncated fraction", color="tab:red")
    ax.set_title("response length (tokens)")


def _plot_curves(records: Records, path: Path) -> Path:
    curves_figure(records).savefig(path, dpi=100)
    return path


def curves_figure(records: Records) -> Any:
    """Reward (mean ± std band, eval reward, pass@1 and pass@k), the loss terms, grad_norm,
    response length and KL / entropy against step, as one matplotlib Figure. (A min..max
    band says nothing on a 0/1 reward: it is always 0..1.)"""
    # The Agg canvas renders without a display and leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 14), layout="constrained")
    FigureCanvasAgg(figure)
    reward_ax, loss_ax, grad_ax, length_ax, kl_ax = figure.subplots(5, 1, sharex=True)
    _reward_panel(reward_ax, records)

    loss_keys = sorted({key for r in records for key in r if key.startswith(NAMESPACE + "loss_")})
    for key in loss_keys:
        loss_ax.plot(*_series(records, key), label=key.removeprefix(NAMESPACE))
    loss_ax.set_title("loss terms")

    grad_ax.plot(*_series(records, NAMESPACE + "grad_norm"))
    grad_ax.set_title("grad_norm")

    _length_panel(length_ax, records)

    for key in ("kl_approx", "kl_to_ref", "entropy"):
        steps, values = _series(records, NAMESPACE + key)
        if steps:
            kl_ax.plot(steps, values, label=key)
    kl_ax.set_title("KL (kl_approx: to the sampling policy) and entropy")
    kl_ax.set_xlabel("step")

    for ax in (reward_ax, loss_ax, length_ax, kl_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    return figure
