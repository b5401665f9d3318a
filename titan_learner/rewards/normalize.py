"""`normalize = "running"`: a reward's scores standardized by running statistics.

A reward model's raw scores have an arbitrary offset and scale, which the weights of a sum of
rewards cannot be chosen for in advance. The mean and variance run over every completion scored
so far, on every rank (the same statistics everywhere), and are saved in the checkpoint so a
resumed run normalizes as the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_MIN_STD = 1e-6


class RunningNorm:
    """Count, mean and sum of squared deviations (Chan et al.'s parallel update)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update(self, values: Sequence[float]) -> None:
        if not values:
            return
        n = float(len(values))
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        return (values - self.mean) / max(self.std, _MIN_STD)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]
