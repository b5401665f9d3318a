"""Training metrics of a GRPO job: console, JSONL, TensorBoard, a progress bar and a final plot.

Only rank 0 records anything; the other ranks hold `Telemetry.disabled()`, so the training loop
calls `log` and `close` the same way everywhere. Training metrics are namespaced
`training/<name>`, evaluation metrics `eval/<name>`; `samples` appends a few completions per step
to `samples.jsonl` for people to read.

`metrics.jsonl` is the durable record: it is flushed after every line, so a crash loses nothing
already logged, and the plot written by `close` is read back from it, so it also covers the steps
of a run this one resumed. A resumed run drops what the previous run logged after its checkpoint
(from the JSONL file, and from TensorBoard through `purge_step`), so no step appears twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from titan_learner.files import atomic_write_text

NAMESPACE = "training/"

# What the one console line per step shows, in this order, when present: the rest goes to the files.
CONSOLE_KEYS = (
    "reward_mean",
    "loss_objective",
    "grad_norm",
    "kl_approx",
    "logprob_mismatch_max",
    "tokens_per_s",
    "rollout_s",
    "update_s",
    "weight_sync_s",
    "reward_errors",
)
SHOWN_WHEN_NONZERO = ("reward_errors",)


class Telemetry:
    """Records per-step metrics of one training run into `output_dir`.

    `start_step` is the last step the run resumes from (0 for a fresh run, which starts the
    JSONL file anew); the first step logged is expected to be `start_step + 1`.
    """

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        *,
        enabled: bool = True,
        progress: bool = True,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.samples_path = self.output_dir / "samples.jsonl"
        if start_step > 0:
            _drop_steps_after(self.jsonl_path, start_step)
            _drop_steps_after(self.samples_path, start_step)
        mode = "a" if start_step > 0 else "w"
        self._jsonl = self.jsonl_path.open(mode)
        self._samples = self.samples_path.open(mode)
        self._tensorboard = SummaryWriter(
            str(self.output_dir / "tensorboard"),
            purge_step=start_step + 1 if start_step > 0 else None,
        )
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            # None: drawn on a terminal only; a log file gets the per-step lines without bars.
            disable=None if progress else True,
            mininterval=1.0,
            unit="step",
            dynamic_ncols=True,
        )

    @classmethod
    def disabled(cls) -> Telemetry:
        """An instance that records nothing, for ranks other than 0."""
        return cls(Path(), 0, enabled=False)

    def log(self, step: int, metrics: dict[str, float], namespace: str = NAMESPACE) -> None:
        """Records one step's metrics (floats or 0-d tensors) everywhere."""
        if not self.enabled:
            return
        values = {name: float(value) for name, value in metrics.items()}
        record = {"step": step, **{namespace + name: value for name, value in values.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step":
                self._tensorboard.add_scalar(key, value, step)
        # tqdm.write prints above the bar, so the bar is redrawn below the line, not broken by it.
        if namespace == NAMESPACE:
            tqdm.write(self._console_line(step, values))
        else:
            shown = "  ".join(f"{name}={value:.4g}" for name, value in values.items())
            tqdm.write(f"{namespace.rstrip('/')} at step {step}  {shown}")
        self._bar.update(step - self._bar.n)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Appends (prompt, completion, rewards) rows of one step to samples.jsonl."""
        if not self.enabled:
            return
        for row in rows:
            self._samples.write(json.dumps({"step": step, **row}) + "\n")
        self._samples.flush()

    def close(self) -> Path | None:
        """Flushes and closes every output and writes `curves.png`; returns its path."""
        if not self.enabled:
            return None
        self._bar.close()
        self._jsonl.close()
        self._samples.close()
        self._tensorboard.close()
        return _plot_curves(_read_records(self.jsonl_path), self.output_dir / "curves.png")

    def _console_line(self, step: int, values: dict[str, float]) -> str:
        shown = [
            f"{name}={values[name]:.4g}"
            for name in CONSOLE_KEYS
            if name in values and (values[name] or name not in SHOWN_WHEN_NONZERO)
        ]
        return "  ".join([f"step {step}/{self.total_steps}", *shown])


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The JSONL records of `path`, without a last line torn by a crash mid-write."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _drop_steps_after(path: Path, last_step: int) -> None:
    """Rewrites `path` (atomically) without the records of steps after `last_step`."""
    if not path.exists():
        return
    kept = [record for record in _read_records(path) if record["step"] <= last_step]
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))


def _plot_curves(records: list[dict[str, Any]], path: Path) -> Path:
    """Reward (mean ± std band, eval reward and pass@k), the loss terms and grad_norm against
    step, in one PNG. (A min..max band says nothing on a 0/1 reward: it is always 0..1.)"""
    # The Agg canvas renders without a display and leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(record["step"], record[key]) for record in records if key in record]
        return [step for step, _ in points], [value for _, value in points]

    figure = Figure(figsize=(7, 9), layout="constrained")
    FigureCanvasAgg(figure)
    reward_ax, loss_ax, grad_ax = figure.subplots(3, 1, sharex=True)

    reward_ax.plot(*series(NAMESPACE + "reward_mean"), label="mean")
    mean, std = NAMESPACE + "reward_mean", NAMESPACE + "reward_std"
    banded = [r for r in records if mean in r and std in r]
    if banded:
        reward_ax.fill_between(
            [r["step"] for r in banded],
            [r[mean] - r[std] for r in banded],
            [r[mean] + r[std] for r in banded],
            alpha=0.25,
            label="mean ± std",
        )
    for key, label in (
        ("eval/reward_mean", "eval reward"),
        ("eval/pass@1", "eval pass@1"),
        ("eval/pass@k", "eval pass@k"),
    ):
        steps, values = series(key)
        if steps:
            reward_ax.plot(steps, values, marker="o", label=label)
    reward_ax.set_title("reward")

    loss_keys = sorted({key for r in records for key in r if key.startswith(NAMESPACE + "loss_")})
    for key in loss_keys:
        loss_ax.plot(*series(key), label=key.removeprefix(NAMESPACE))
    loss_ax.set_title("loss terms")

    grad_ax.plot(*series(NAMESPACE + "grad_norm"))
    grad_ax.set_title("grad_norm")
    grad_ax.set_xlabel("step")

    for ax in (reward_ax, loss_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    figure.savefig(path, dpi=100)
    return path
