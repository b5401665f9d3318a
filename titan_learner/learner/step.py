"""What the TorchRL stepper calls back, and the micro-batch it runs: `StepperTrainer`.

A TorchRL `OptimizationStepper` drives each micro-batch (`_step(trainer, batch)`): it calls the
trainer's `compute_loss` and reads `loss_module`, `optimizer`, `clip_grad_norm` and `clip_norm`
from it; the learner's own stepper also reads `loss_agreed_finite` (compute_loss's agreement
over the world) and `summed_loss` (the sum of the loss terms, taken already). The Learner is
that trainer: this base class holds what it does per micro-batch (the loss, its agreement over
ranks, the step's normalization and the window's metrics), the contract (titan_learner.learner.
contract) the rest.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from titan_learner.learner.batch import check_and_count
from titan_learner.learner.loss.losses import LeanForward
from titan_learner.learner.loss.normalization import (
    MetricTerms,
    StepNormalization,
    WindowMetrics,
    averaged_over_counts,
    counts_of,
    metric_terms,
    micro_batch_counts,
    sums_and_maxima_over,
    term_kind,
)
from titan_learner.learner.microbatch import token_budget_micro_batches

if TYPE_CHECKING:
    from torch import nn
    from torchrl.trainers.trainers import OptimizationStepper

    from titan_learner.config.schema import Config


class StepperTrainer:
    """The trainer a TorchRL stepper steps: `compute_loss` and `update` (one micro-batch).

    Set by the Learner's constructor: `config`, `model`, `loss_module`, `optimizer`,
    `lr_scheduler`, `stepper`, `capabilities`, `device`, `data_parallel_group`, `vocab_size`,
    `clip_norm`, and the counters `step` and `policy_version`.
    """

    clip_grad_norm = True
    loss_agreed_finite: bool | None = None
    summed_loss: torch.Tensor | None = None
    config: Config
    model: nn.Module
    loss_module: nn.Module
    stepper: OptimizationStepper

    def restart_window(self) -> None:
        """update()'s normalization state (titan_learner.learner.loss.normalization), fresh:
        at construction, and after a load (gradients are not saved: the window restarts)."""
        self._pending: dict[str, float] | None = None  # counts to sum before this backward
        self._in_update = False
        self._terms = MetricTerms()
        self._normalization = StepNormalization()
        self._window = WindowMetrics()

    def compute_loss(self, batch: TensorDictBase, method: str | None = None) -> TensorDictBase:
        """Run the loss module; make a non-finite loss on any rank non-finite on every rank.

        A rank that skipped backward while others ran it would hang the gradient collectives,
        so the stepper's drop-the-window decision must be the same everywhere.
        """
        module = self.loss_module if method is None else getattr(self.loss_module, method)
        self.summed_loss = None
        # Edited as a dict, a TensorDict built once at the end: the learner's own loss classes
        # hand their entries over as one, without TorchRL's output class, their diagnostics
        # (log-prob mismatch, token-mean clip fractions and entropy) among them.
        if method is None and isinstance(module, LeanForward):
            out = module(batch, as_dict=True)
        else:
            out = dict(module(batch).items())
        loss_keys = [k for k in out if isinstance(k, str) and k.startswith("loss")]
        if not loss_keys:
            raise RuntimeError(
                f"{type(self.loss_module).__name__} returned no key starting with 'loss' "
                f"(got {sorted(map(str, out))}); the learner trains on their sum"
            )
        total = functools.reduce(operator.add, (out[k] for k in loss_keys))
        if total.numel() != 1:
            raise ValueError(
                f"the summed loss has shape {tuple(total.shape)}, not a scalar: the loss module "
                "must reduce over the batch (e.g. reduction='mean' / aggregation='token_mean', "
                "not 'none')"
            )
        for key in loss_keys:  # TorchRL's prompt_mean reduces to shape [1]: one value all the same
            if out[key].dim():
                out[key] = out[key].reshape(())
        if total.dim():
            total = total.reshape(())
        # Across processes the update's metrics ride on the agreement's collective.
        riding = self._in_update and self._several_processes()
        terms, payload = MetricTerms(), None
        if riding:
            terms = metric_terms(out)
            payload = self._window.payload(
                terms,
                self._normalization.counts,
                self.loss_module,
                dist.get_world_size(),
                dist.get_rank(),
            )
        finite, summed, metrics = self._agree(total, payload)  # read only: no detach
        self.loss_agreed_finite = finite  # the stepper's guard reads it instead of the device
        if not finite:
            for key in loss_keys:
                out[key] = out[key] * torch.nan
        if riding:
            self._window.add_summed(terms.keys, metrics, dist.get_world_size(), not finite)
        if self._in_update:  # see titan_learner.learner.loss.normalization
            self._terms = MetricTerms() if riding else metric_terms(out)
            accumulation = getattr(self.stepper, "gradient_accumulation_steps", 1)
            scales = self._normalization.scales(
                summed, self.capabilities.data_parallel_size, accumulation
            )
            for key in loss_keys:
                scale = scales[term_kind(self.loss_module, key)]
                if scale != 1.0:  # one process, one micro-batch: 1.0, and x * 1.0 is x
                    out[key] = out[key] * scale
                    total = None
        if finite:  # the terms' sum as the stepper would take it (None: scaled, to sum again)
            self.summed_loss = total
        return TensorDict(out, batch_size=[])

    def update(
        self,
        batch: TensorDictBase,
        *,
        step_counts: Mapping[str, float] | None = None,
        per_microbatch_mean: bool = False,
    ) -> TensorDict:
        """One micro-batch: forward, backward and, at the end of an accumulation window, a step.

        The step's loss is the mean over all of its tokens (or rows, for `prompt_mean`), across
        micro-batches and data-parallel ranks: it equals the one-process loss on the
        concatenated batch (titan_learner.learner.loss.normalization). With gradient accumulation,
        pass every micro-batch of the window the same `step_counts` (this rank's counts over
        the whole window: `normalization.step_counts(micro_batches)`). Without them a loss
        that averages over tokens or rows is a ValueError when a window has several
        micro-batches: each would be normalized over its own tokens, a different objective
        that `per_microbatch_mean=True` asks for explicitly (exact for equal micro-batches).

        With `[learner] max_tokens_per_microbatch = N` (and `grad_accum_steps = 1`), `batch` is
        this rank's whole step: the learner splits it by length into micro-batches of at most N
        computed positions (titan_learner.learner.microbatch) and takes one optimizer step.

        Returns detached scalar metrics over data-parallel ranks, for the window so far: on
        the call that closes it, the whole step's loss terms (token- or row-weighted like
        the loss) and token-weighted diagnostics. `grad_norm` and `lr` appear only on calls
        that closed a window. Every rank must call it.
        """
        if step_counts is None and not per_microbatch_mean:
            self._refuse_per_microbatch_means()
        needs_ref = bool(getattr(self.loss_module, "kl_to_ref_coeff", None))
        batch, trained = check_and_count(batch, self.vocab_size, needs_ref, self.device)
        budget = self.config.learner.max_tokens_per_microbatch
        if not budget:
            counts = counts_of(trained, batch.batch_size[0])
            return self._report(*self._update_one(batch, step_counts, counts))
        one_window = getattr(self.stepper, "one_window", None)
        if one_window is None or self.config.learner.grad_accum_steps != 1 or step_counts:
            raise ValueError(
                "max_tokens_per_microbatch makes each update() one optimizer step over the "
                "rank's whole batch; allowed: grad_accum_steps = 1, no step_counts, and the "
                "learner's own stepper (TitanOptimizationStepper)"
            )
        micros = token_budget_micro_batches(batch, budget, self._most_over_ranks)
        each = [micro_batch_counts(micro) for micro in micros]
        window = {kind: sum(counts[kind] for counts in each) for kind in each[0]}
        skipped = self.stepper.skipped_nonfinite_steps
        with one_window(len(micros)):
            for micro, counts in zip(micros, each, strict=True):
                result = self._update_one(micro, window, counts)
                if self.stepper.skipped_nonfinite_steps != skipped:
                    break  # the window was dropped, on every rank alike (see compute_loss)
        return self._report(*result)

    def _refuse_per_microbatch_means(self) -> None:
        """Accumulation without `step_counts` would silently train another objective."""
        accumulation = getattr(self.stepper, "gradient_accumulation_steps", 1)
        averaged = averaged_over_counts(self.loss_module)
        if accumulation > 1 and averaged:
            raise ValueError(
                f"update() without step_counts, with grad_accum_steps = {accumulation} and a "
                f"loss averaged over counts ({averaged}), would average each micro-batch over "
                "its own tokens, not the step's; allowed: step_counts=step_counts(micro_batches) "
                "(titan_learner.step_counts) on every micro-batch of the window, "
                "[learner] max_tokens_per_microbatch, or per_microbatch_mean=True to train on "
                "per-micro-batch means"
            )

    def _update_one(
        self,
        batch: TensorDictBase,
        step_counts: Mapping[str, float] | None,
        counts: dict[str, float] | None = None,
    ) -> tuple[TensorDictBase, float, bool]:
        """One checked micro-batch through the stepper: (its metrics, the lr, window over).
        `counts`: the micro-batch's own (`micro_batch_counts`), when the caller has them."""
        counts = micro_batch_counts(batch) if counts is None else counts
        accumulation = getattr(self.stepper, "gradient_accumulation_steps", 1)
        self._pending = self._normalization.begin(
            counts, step_counts, self._window_position(), accumulation
        )
        self._in_update = True
        if not self.model.training:  # train() walks every module: not on every micro-batch
            self.model.train()
        steps_before = getattr(self.stepper, "optimizer_step_count", None)
        lr = self.lr_scheduler.schedulers[0].get_last_lr()[0]  # the rate this step applies
        try:
            metrics = self.stepper._step(self, batch)
        finally:
            self._in_update, self._pending = False, None
        if steps_before is None:  # a stepper without a counter steps on every call it reports
            stepped = "grad_norm" in metrics.keys()
        else:
            stepped = self.stepper.optimizer_step_count > steps_before
        if stepped:
            # TorchTitan's schedule is defined over [run] steps; past it, the last rate holds.
            if self.lr_scheduler.schedulers[0].last_epoch < self.config.run.steps:
                self.lr_scheduler.step()
            self.policy_version += 1
        window_over = stepped or self._window_position() == 0  # stepped, or dropped
        if window_over:
            self.step += 1
        self._window.add(self._terms.values(), counts, self.loss_module)
        return metrics, lr, window_over

    def _report(self, metrics: TensorDictBase, lr: float, window_over: bool) -> TensorDict:
        """The window's metrics so far over data-parallel ranks, plus the stepper's own."""
        means = self._window.result(self._reduce)
        if window_over:
            self._window = WindowMetrics()
        stepped = "grad_norm" in metrics.keys()
        if stepped:
            means["lr"] = lr
        out = dict(zip(means, torch.tensor(list(means.values())).unbind(), strict=True))
        if stepped:  # already global: computed over DTensor grads
            out["grad_norm"] = metrics.get("grad_norm").detach().float().cpu()
        out["skipped_nonfinite_steps"] = torch.tensor(
            getattr(self.stepper, "skipped_nonfinite_steps", 0)
        )
        return TensorDict(out, batch_size=[])

    def _most_over_ranks(self, count: int) -> int:
        """The largest `count` of any data-parallel rank (one all-reduce)."""
        return int(self._reduce({}, {"count": float(count)})[1]["count"])

    def _several_processes(self) -> bool:
        return dist.is_initialized() and self.capabilities.world_size > 1

    def _agree(
        self, loss: torch.Tensor, payload: torch.Tensor | None = None
    ) -> tuple[bool, dict[str, float] | None, list[float]]:
        """One collective before backward: is the (summed) loss finite on every rank, the pending
        counts (`StepNormalization.begin`) summed over data-parallel ranks, and `payload`
        (`WindowMetrics.payload`) summed over the world.

        A rank that skipped backward while others ran it would hang the gradient collectives,
        so the drop decision is taken over the whole world. Ranks of one tensor-parallel group
        hold the same batch: the world's sum of the counts is their sum times the TP size (the
        payload's weighted terms and weights both carry that factor, which their ratios drop).
        In a one-process world there is nothing to agree on: the loss alone is read (one
        value, where `torch.isfinite` would be four operators on a CPU before the same read).
        """
        pending = self._pending or {}
        if not self._several_processes():
            finite = math.isfinite(loss.item())  # a read, no detach (float() would warn)
            return finite, dict(pending) if self._pending is not None else None, []
        device = loss.device
        local = torch.cat(
            [
                (~torch.isfinite(loss)).to(torch.float64).reshape(1),
                torch.tensor(list(pending.values()), dtype=torch.float64, device=device),
                torch.zeros(0, dtype=torch.float64, device=device)
                if payload is None
                else payload.to(device),
            ]
        )
        dist.all_reduce(local)
        nonfinite, *values = local.tolist()
        sums, rest = values[: len(pending)], values[len(pending) :]
        tp = self.capabilities.tensor_parallel_size
        summed = dict(zip(pending, (v / tp for v in sums), strict=True))
        return nonfinite == 0, summed if self._pending is not None else None, rest

    def _reduce(
        self, sums: dict[str, float], maxima: dict[str, float] | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """`sums` summed and `maxima` maximized over data-parallel ranks, in one all-reduce."""
        return sums_and_maxima_over(self.data_parallel_group, self.device, sums, maxima)

    def _window_position(self) -> int:
        """Micro-batches into the current accumulation window (0: the window just closed)."""
        micro_step = getattr(self.stepper, "micro_step", 0)
        return micro_step % getattr(self.stepper, "gradient_accumulation_steps", 1)
