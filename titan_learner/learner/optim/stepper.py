"""TorchRL's MixedPrecisionOptimizationStepper, taught to defer FSDP gradient reduction and to
clip on local gradient shards.

Upstream accumulates gradients over `gradient_accumulation_steps` micro-batches but never tells
FSDP, so every micro-batch pays a reduce-scatter. Here the cross-rank reduction runs only on the
last micro-batch of a window (`set_requires_gradient_sync`), which gives the same gradients.
Upstream clips with `torch.nn.utils.clip_grad_norm_`, whose DTensor operations were ~5% of a
small model's step on a CPU; here `titan_learner.learner.optim.clipping` computes the same norm from
the local shards with one all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchrl._utils import logger as torchrl_logger
from torchrl.trainers.trainers import MixedPrecisionOptimizationStepper, OptimizationStepper

from titan_learner.dtypes import DTYPES
from titan_learner.learner.optim.clipping import clip_grad_norm_

if TYPE_CHECKING:
    from titan_learner.config.schema import LearnerSection


class TitanOptimizationStepper(MixedPrecisionOptimizationStepper):
    """Upstream stepping (autocast, accumulation, non-finite guards) + deferred sync, clipping
    on local shards.

    Its metrics are the gradient norm alone: the learner reads the loss terms and diagnostics
    from the loss output itself (`titan_learner.learner.loss.normalization.metric_terms`), so the
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
        """Upstream's step (forward under autocast, the non-finite loss guard that drops the
        window, backward, and every `gradient_accumulation_steps` calls clipping, the
        non-finite gradient guard and the optimizer step), clipping on local shards. fp16's
        GradScaler and a stepper without clipping take upstream's own path."""
        closes_window = (self._micro_step + 1) % self.gradient_accumulation_steps == 0
        self._set_gradient_sync(closes_window)
        if self._use_scaler or self.clip_norm is None:
            return super().step(trainer, sub_batch)
        # Outside any autocast, a disabled region would only save and restore that state.
        autocast = (
            torch.amp.autocast(
                self.device_type, enabled=self.mixed_precision, dtype=self.autocast_dtype
            )
            if self.mixed_precision or torch.is_autocast_enabled(self.device_type)
            else contextlib.nullcontext()
        )
        with autocast:
            losses_td = trainer.compute_loss(sub_batch)
            loss_items = [v for k, v in losses_td.items() if k.startswith("loss")]
            if not loss_items:
                raise RuntimeError(
                    "The loss module returned no 'loss_*' keys. "
                    "Make sure your loss module prefixes scalar outputs with 'loss'."
                )
            # The learner's compute_loss has summed the terms already: no second sum.
            loss = getattr(trainer, "summed_loss", None)
            if loss is None:
                loss = functools.reduce(operator.add, loss_items)
            if self.gradient_accumulation_steps != 1:
                loss = loss / self.gradient_accumulation_steps
        metrics = self._reduce_metrics(losses_td)
        # The learner's compute_loss has agreed on it over the world already: no second read.
        finite = getattr(trainer, "loss_agreed_finite", None)
        if finite is None:
            finite = bool(torch.isfinite(loss.detach()).all())
        if not finite:  # it would poison the whole window
            self._skipped_nonfinite_steps += 1
            torchrl_logger.warning(
                f"Skipping optimization step because the loss is non-finite: {loss.detach()}. "
                f"Skipped non-finite steps: {self._skipped_nonfinite_steps}."
            )
            self.optimizer.zero_grad(set_to_none=True)
            self._micro_step = 0
            return metrics
        loss.backward()
        self._micro_step += 1
        if self._micro_step % self.gradient_accumulation_steps:
            return metrics
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(clip_grad_norm_(params, self.clip_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self._optimizer_step_count += 1
        else:  # nothing else skips an overflowing update without a GradScaler
            self._skipped_nonfinite_steps += 1
            torchrl_logger.warning(
                f"Skipping optimizer step because the gradient norm is non-finite: {grad_norm}. "
                f"Skipped non-finite steps: {self._skipped_nonfinite_steps}."
            )
            grad_norm = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"] = torch.tensor(grad_norm)
        return metrics

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


def adopt_stepper(
    stepper: OptimizationStepper | None,
    optimizer,
    *,
    model: nn.Module,
    learner: LearnerSection,
    clip_norm: float,
    device_type: str,
) -> OptimizationStepper:
    """The learner's stepper: `TitanOptimizationStepper` over `optimizer` by default, or a
    caller's TorchRL stepper (which gets `optimizer` where it reads the trainer's)."""
    if stepper is None:
        return TitanOptimizationStepper(
            optimizer,
            model=model,
            mixed_precision=learner.mixed_precision,
            autocast_dtype=DTYPES[learner.autocast_dtype],
            gradient_accumulation_steps=learner.grad_accum_steps,
            clip_norm=clip_norm,
            device_type=device_type,
        )
    if not isinstance(stepper, OptimizationStepper):
        raise TypeError(
            f"stepper must be a torchrl OptimizationStepper, got {type(stepper).__name__}"
        )
    if getattr(stepper, "optimizer", None) is None:
        # Steppers that read trainer.optimizer (DefaultOptimizationStepper, TD3) get ours.
        stepper.optimizer = optimizer
    return stepper
