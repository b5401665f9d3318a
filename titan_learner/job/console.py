"""What a training run prints while it runs: a progress bar on a terminal, plain lines in a log.

On a terminal (stderr is a TTY) one bar shows the steps, the time elapsed and left, and the key
figures (mean reward, tokens/s); evaluation results print above it. Off a terminal (a log file,
CI), where a bar is a mess of carriage returns, the plain line of a step's main metrics prints
every `[logging] log_every` steps and at the last step. `--verbose` prints every metric of every
`log_every`-th step (above the bar on a terminal); `--quiet` prints no step and no evaluation.
The files (metrics.jsonl, TensorBoard, W&B) get every step whatever is printed.
"""

from __future__ import annotations

import sys
from typing import Literal

from tqdm import tqdm

Verbosity = Literal["quiet", "normal", "verbose"]
VERBOSITIES: tuple[Verbosity, ...] = ("quiet", "normal", "verbose")

# What the plain line shows, in this order, when present: the rest goes to the files.
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
BAR_KEYS = {"reward_mean": ("reward", "{:.3f}"), "tokens_per_s": ("tok/s", "{:.0f}")}
"""The key figures beside the bar, under short names."""


class Console:
    """Prints one run's progress. `terminal`: None detects it (stderr is a TTY)."""

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        log_every: int = 1,
        verbosity: Verbosity = "normal",
        terminal: bool | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.log_every = log_every
        self.verbosity = verbosity
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                mininterval=0.5,
                file=sys.stderr,
            )
            if self.terminal and verbosity != "quiet"
            else None
        )

    def step(self, step: int, values: dict[str, float]) -> None:
        """One training step's metrics (names without the `training/` namespace)."""
        if self._bar is not None:
            self._bar.set_postfix_str(_bar_figures(values), refresh=False)
            self._bar.update(step - self._bar.n)
        due = step % self.log_every == 0 or step == self.total_steps
        if self.verbosity == "verbose" and due:
            self._write(_line(step, self.total_steps, values, every_metric=True))
        elif self.verbosity == "normal" and not self.terminal and due:
            self._write(_line(step, self.total_steps, values, every_metric=False))

    def event(self, text: str) -> None:
        """A line that is no step (an evaluation's results), unless quiet."""
        if self.verbosity != "quiet":
            self._write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _write(self, text: str) -> None:
        # tqdm.write prints above the bar, so the bar is redrawn below the line, not broken by it.
        tqdm.write(text, file=sys.stdout)


def _bar_figures(values: dict[str, float]) -> str:
    return "  ".join(
        f"{short}={form.format(values[name])}"
        for name, (short, form) in BAR_KEYS.items()
        if name in values
    )


def _line(step: int, total: int, values: dict[str, float], every_metric: bool) -> str:
    names = sorted(values) if every_metric else [n for n in CONSOLE_KEYS if n in values]
    shown = [
        f"{name}={values[name]:.4g}"
        for name in names
        if values[name] or name not in SHOWN_WHEN_NONZERO
    ]
    return "  ".join([f"step {step}/{total}", *shown])
