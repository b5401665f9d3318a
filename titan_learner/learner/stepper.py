"""TorchRL's MixedPrecisionOptimizationStepper, taught to defer FSDP gradient reduction.

Upstream accumulates gradients over `gradient_accumulation_steps` micro-batches but never tells
FSDP, so every micro-batch pays a reduce-scatter. Here the cross-rank reduction runs only on the
last micro-batch of a window (`set_requires_gradient_sync`), which gives the same gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchrl.trainers.trainers import MixedPrecisionOptimizationStepper


class TitanOptimizationStepper(MixedPrecisionOptimizationStepper):
    """Upstream stepping (autocast, accumulation, non-finite guard, clipping) + deferred sync.

    Its metrics are the gradient norm alone: the learner reads the loss terms and diagnostics
    from the loss output itself (`titan_learner.learner.normalization.metric_terms`), so the
    upstream copy of every output entry into a metrics TensorDict is skipped.
    """

    def __init__(self, optimizer, *, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.model = model
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._gradient_sync: bool | None = None  # what the FSDP modules were last told

    def _set_gradient_sync(self, enabled: bool) -> None:
        """FSDP's flag persists, so it is set only when it changes (once, without accumulation)."""
        if enabled != self._gradient_sync:
            for module in self._fsdp_modules:
                module.set_requires_gradient_sync(enabled, recurse=False)
            self._gradient_sync = enabled

    @property
    def micro_step(self) -> int:
        return self._micro_step

    @property
    def skipped_nonfinite_steps(self) -> int:
        return self._skipped_nonfinite_steps

    def step(self, trainer: Any, sub_batch: TensorDictBase) -> TensorDictBase:
        closes_window = (self._micro_step + 1) % self.gradient_accumulation_steps == 0
        self._set_gradient_sync(closes_window)
        return super().step(trainer, sub_batch)

    @staticmethod
    def _reduce_metrics(losses_td: TensorDictBase) -> TensorDictBase:
        return TensorDict({}, batch_size=[])

    @contextmanager
    def one_window(self, micro_batches: int) -> Iterator[None]:
        """The next `micro_batches` calls accumulate into one optimizer step, then the
        configured accumulation returns (token-budget micro-batches: one window per update)."""
        if self._micro_step % self.gradient_accumulation_steps:
            raise RuntimeError("one_window() inside an open accumulation window")
        configured = self.gradient_accumulation_steps
        self.gradient_accumulation_steps, self._micro_step = micro_batches, 0
        try:
            yield
        finally:
            self.gradient_accumulation_steps, self._micro_step = configured, 0

    def counters(self) -> dict[str, int]:
        """Counters without the optimizer (the Learner checkpoints the optimizer itself)."""
        return {
            "micro_step": self._micro_step,
            "optimizer_step_count": self._optimizer_step_count,
            "skipped_nonfinite_steps": self._skipped_nonfinite_steps,
        }

    def load_counters(self, counters: dict[str, int]) -> None:
        self._micro_step = int(counters["micro_step"])
        self._optimizer_step_count = int(counters["optimizer_step_count"])
        self._skipped_nonfinite_steps = int(counters["skipped_nonfinite_steps"])
