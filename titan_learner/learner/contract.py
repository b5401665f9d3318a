"""The Learner contract: update(batch), weights out, checkpoint state in and out.

`Learner` holds the contract once; `LocalLearner` (one process, plain model: the reference every
parity test compares against) and `TitanLearner` (TorchTitan-built and -sharded) differ only in
how they build the model and which process groups they reduce over.

Collectives: `update`, `checkpoint`, `load_checkpoint` and `get_weights` must be called by every
rank of the world, the same number of times, in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.trainers.trainers import OptimizationStepper

from titan_learner.checkpoint.packing import pack_param_groups, unpack_param_groups
from titan_learner.config.schema import Config
from titan_learner.dtypes import DTYPES
from titan_learner.learner.batch import REF_LOG_PROBS_KEY, check_and_count
from titan_learner.learner.guards import (
    OptimizerCoverageCheck,
    load_loss_own_state,
    loss_own_state,
    reject_unsynchronized_loss_parameters,
)
from titan_learner.learner.losses import LeanForward, build_loss, record, token_mean_diagnostics
from titan_learner.learner.microbatch import token_budget_micro_batches
from titan_learner.learner.normalization import (
    MetricTerms,
    StepNormalization,
    WindowMetrics,
    aggregation_kind,
    averaged_over_counts,
    counts_of,
    metric_terms,
    micro_batch_counts,
    step_counts,
    sums_and_maxima_over,
    term_kind,
)
from titan_learner.learner.optimizer import build_lr_scheduler, build_optimizer
from titan_learner.learner.policy import TitanPolicy
from titan_learner.learner.reference_scoring import Reference, with_reference_log_probs
from titan_learner.learner.stepper import TitanOptimizationStepper
from titan_learner.ranks import rank
from titan_learner.weights.export import DEFAULT_BUCKET_BYTES, WeightExport, iter_hf_tensors

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this learner can do, for callers that adapt (e.g. a job choosing a weight sink)."""

    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    device_type: str
    param_dtype: str
    gradient_accumulation: bool
    sharded: bool


class Learner:
    """A policy model, a TorchRL loss and a TorchRL optimization stepper behind one contract.

    The stepper drives each `update`: it calls back `compute_loss` and reads `loss_module`,
    `optimizer`, `clip_grad_norm` and `clip_norm` from this object (its "trainer"), and the
    learner's own stepper `loss_agreed_finite` (compute_loss's agreement over the world) and
    `summed_loss` (the sum of the returned loss terms, which compute_loss has taken already).
    """

    clip_grad_norm = True
    loss_agreed_finite: bool | None = None
    summed_loss: torch.Tensor | None = None
    parallel_dims: ParallelDims | None = None  # TorchTitan's mesh; None for LocalLearner

    def __init__(
        self,
        *,
        config: Config,
        model: nn.Module,
        spec: ModelSpec,
        loss_module: nn.Module | None,
        stepper: OptimizationStepper | None,
        device: torch.device,
        data_parallel_group: dist.ProcessGroup | None,
        capabilities: Capabilities,
        tensor_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.spec = spec
        self.device = device
        self.policy = TitanPolicy(
            model,
            logprob_chunk_size=config.learner.logprob_chunk_size,
            share_prompts=config.learner.share_prompts,
        )
        self.loss_module = (
            loss_module
            if loss_module is not None
            else build_loss(
                config.loss,
                self.policy,
                max_new_tokens=config.rollout.max_new_tokens,
                kl_estimator=config.kl.estimator if config.kl.placement == "loss" else None,
            )
        )
        reject_unsynchronized_loss_parameters(
            self.loss_module, model, capabilities.data_parallel_size
        )
        aggregation_kind(self.loss_module)  # one the step's normalization knows, before compute
        self.capabilities = capabilities
        self.data_parallel_group = data_parallel_group
        self.tensor_parallel_group = tensor_parallel_group
        # 0 disables clipping; an infinite threshold still computes (and reports) the norm and
        # keeps TorchRL's non-finite-gradient guard, which None would turn off.
        self.clip_norm = config.learner.clip_norm or math.inf
        self.optimizer = build_optimizer(model, config, device.type)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)
        self.stepper = self._adopt_stepper(stepper)
        self.optimizer = self.stepper.optimizer
        self._coverage = OptimizerCoverageCheck(
            self.optimizer, lambda: [self.model, self.loss_module]
        )
        self.step = 0
        self.policy_version = 0
        self.vocab_size = model.config.vocab_size
        # update()'s normalization state (titan_learner.learner.normalization)
        self._pending: dict[str, float] | None = None  # counts to sum before this backward
        self._in_update = False
        self._terms = MetricTerms()
        self._normalization = StepNormalization()
        self._window = WindowMetrics()

    # -- construction -------------------------------------------------------------------------

    def _adopt_stepper(self, stepper: OptimizationStepper | None) -> OptimizationStepper:
        learner = self.config.learner
        if stepper is None:
            return TitanOptimizationStepper(
                self.optimizer,
                model=self.model,
                mixed_precision=learner.mixed_precision,
                autocast_dtype=DTYPES[learner.autocast_dtype],
                gradient_accumulation_steps=learner.grad_accum_steps,
                clip_norm=self.clip_norm,
                device_type=self.device.type,
            )
        if not isinstance(stepper, OptimizationStepper):
            raise TypeError(
                f"stepper must be a torchrl OptimizationStepper, got {type(stepper).__name__}"
            )
        if getattr(stepper, "optimizer", None) is None:
            # Steppers that read trainer.optimizer (DefaultOptimizationStepper, TD3) get ours.
            stepper.optimizer = self.optimizer
        return stepper

    # -- the stepper's trainer interface --------------------------------------------------------

    def compute_loss(self, batch: TensorDictBase, method: str | None = None) -> TensorDictBase:
        """Run the loss module; make a non-finite loss on any rank non-finite on every rank.

        A rank that skipped backward while others ran it would hang the gradient collectives,
        so the stepper's drop-the-window decision must be the same everywhere.
        """
        module = self.loss_module if method is None else getattr(self.loss_module, method)
        record(  # what this forward sets (losses.LogProbMismatch, TokenMeanDiagnostics)
            self.loss_module, logprob_mismatch=None, positions_per_token=None
        )
        self.summed_loss = None
        # Edited as a dict, a TensorDict built once at the end: the learner's own loss classes
        # hand their entries over as one, without TorchRL's output class.
        if method is None and isinstance(module, LeanForward):
            out = module(batch, as_dict=True)
        else:
            out = dict(module(batch).items())
        token_mean_diagnostics(out, self.loss_module)
        if self.loss_module.logprob_mismatch is not None:
            out["logprob_mismatch"], out["logprob_mismatch_max"] = self.loss_module.logprob_mismatch
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
        if self._in_update:  # see titan_learner.learner.normalization
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

    # -- the contract -------------------------------------------------------------------------

    def train_step(
        self, rank_batch: TensorDictBase, reference: Reference | None = None
    ) -> TensorDict:
        """One optimizer step over this rank's whole batch: split, counted and, with a
        `reference`, scored for the KL to it (unless the batch carries its log-probs already).

        The split: `[learner] max_tokens_per_microbatch = N` hands the batch to one `update`,
        which packs it by length (titan_learner.learner.microbatch); otherwise it is cut into
        `[learner] grad_accum_steps` micro-batches by count, each updated with the step's
        counts (`normalization.step_counts`), so the loss is the step's mean over all of its
        tokens. Returns the metrics of the call that stepped. Every rank must call it.
        """
        if reference is not None and REF_LOG_PROBS_KEY not in rank_batch.keys(True):
            rank_batch = self.score_reference(rank_batch, reference)
        if self.config.learner.max_tokens_per_microbatch:
            return self.update(rank_batch)
        micros = rank_batch.chunk(self.config.learner.grad_accum_steps)
        counts = step_counts(micros)  # the step's mean is over all its tokens
        for micro in micros:
            metrics = self.update(micro, step_counts=counts)
        return metrics

    def score_reference(self, rank_batch: TensorDictBase, reference: Reference) -> TensorDict:
        """The batch with the reference's log-probs, scored in the micro-batches by count that
        `train_step` takes (whole under a token budget). A collective.

        For callers that need them before the step (a KL in the reward changes the advantages;
        `mask_truncated` drops rows): `train_step` then keeps the ones the batch carries."""
        budget = self.config.learner.max_tokens_per_microbatch
        parts = 1 if budget else self.config.learner.grad_accum_steps
        return with_reference_log_probs(rank_batch, reference, parts)

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
        concatenated batch (titan_learner.learner.normalization). With gradient accumulation,
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
                "(titan_learner.learner.normalization) on every micro-batch of the window, "
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
                torch.zeros(0, dtype=torch.float64) if payload is None else payload.to(device),
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

    def iter_weights(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        cpu_offload: bool = True,
        checksum: bool = True,
    ) -> WeightExport:
        """Stream the weights as buckets of (Hugging Face name, full plain tensor).

        A collective: every rank iterates to the end. Extra memory per rank is about one bucket.
        cpu_offload=True: CPU tensors on rank 0, empty buckets elsewhere; False: tensors on the
        learner's device on every rank. dtype defaults to [learner] export_dtype. The returned
        export's `manifest` (names, shapes, dtypes, version, checksum) is set once iterated.
        checksum=False skips hashing the bytes (a device-to-host copy of every tensor on GPU)
        where they never leave the process; names and shapes are still in the manifest.
        """
        dtype = dtype or DTYPES[self.config.learner.export_dtype]
        return WeightExport(
            iter_hf_tensors(self.model, self.spec),
            version=self.policy_version,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            device=torch.device("cpu") if cpu_offload else self.device,
            keep=not cpu_offload or rank() == 0,
            checksum=checksum,
        )

    @torch.no_grad()
    def get_weights(self, cpu_offload: bool = True, dtype: torch.dtype | None = None) -> TensorDict:
        """All weights as one flat TensorDict keyed by Hugging Face name (see iter_weights).

        cpu_offload=True: CPU copies on rank 0, an empty TensorDict on other ranks.
        cpu_offload=False: full tensors on the learner's device, on every rank.
        """
        export = self.iter_weights(
            bucket_bytes=2**62, dtype=dtype, cpu_offload=cpu_offload, checksum=False
        )
        return TensorDict(dict(pair for bucket in export for pair in bucket), batch_size=[])

    # -- state: in memory (checkpoint / state_dict), on disk (save / load) --------------------

    def checkpoint(self, *, clone: bool = True) -> dict[str, Any]:
        """This rank's state in memory, as cloned tensors (writes nothing to disk).

        Model and optimizer shards, LR scheduler, stepper counters, the loss module's own
        parameters and buffers, step and policy version. Gradients are not saved.
        A collective on sharded learners; `save` is the on-disk form.

        clone=False: the tensors as the model's and optimizer's `state_dict()` return them, not
        cloned (the live ones, but where a state-dict hook derives them, as TorchTitan's fused
        QKV split does): what a load fills in place before `load_checkpoint`, and what a
        synchronous save writes from, without copying the whole state first. Never keep it.
        """
        copy = _clone if clone else dict
        counters = self.stepper.counters() if hasattr(self.stepper, "counters") else {}
        return {
            "model": copy(self.model.state_dict()),
            "optimizer": self._optimizer_state(copy),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "loss": copy(loss_own_state(self.loss_module, self.model)),
            "stepper": counters,
            "step": self.step,
            "policy_version": self.policy_version,
        }

    def _optimizer_state(self, copy: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Optimizer state (`copy`: cloned or not), without side effects on a learner that
        never stepped.

        TorchTitan materializes missing Adam state with a zero-lr step, which leaves `step` at 1
        and would make the next update differ from that of a learner never checkpointed:
        step 0 with zero moments is exactly a fresh Adam, so the count is put back.
        """
        fresh = not any(optimizer.state for optimizer in self.optimizer.optimizers)
        state = copy(self.optimizer.state_dict())
        if fresh:
            for optimizer in self.optimizer.optimizers:
                for param_state in optimizer.state.values():
                    param_state["step"].zero_()
            for key, value in state.items():
                if key.endswith(".step") and isinstance(value, torch.Tensor):
                    value.zero_()
        return pack_param_groups(state)  # one record instead of one per parameter and setting

    def save(self, directory: str, **options: Any) -> Any:
        """Write a DCP checkpoint to disk (a collective on every rank): see
        titan_learner.checkpoint.save.

        Rank 0 also writes the resolved config and the model's architecture beside the steps
        (`directory/config.toml`, `model_config.json`), so a checkpoint says which model it
        holds even without its `hf_checkpoint` (`python -m titan_learner export` reads them).
        """
        from titan_learner import checkpoint
        from titan_learner.checkpoint.layout import save_resolved_config
        from titan_learner.model.architecture_record import record_architecture

        if rank() == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
            save_resolved_config(self.config, directory)
            record_architecture(self.spec, directory)
        return checkpoint.save(self, directory, **options)

    def load(
        self, directory: str, *, hyperparameters_from_config: bool = False, **options: Any
    ) -> Any:
        """Restore a DCP checkpoint from disk (a collective on every rank): see
        titan_learner.checkpoint.load.

        hyperparameters_from_config=True: the optimizer's lr, betas, eps and weight decay and
        the loss's own buffers (e.g. its clip bounds) keep this learner's config instead of the
        checkpoint's: a resume whose config changed them follows the config. The learning-rate
        schedule keeps its position (the step).
        """
        from titan_learner import checkpoint

        buffers = {  # the config's values, kept only when they are to win over the checkpoint's
            name: tensor.detach().clone()
            for name, tensor in loss_own_state(self.loss_module, self.model).items()
            if hyperparameters_from_config and not isinstance(tensor, nn.Parameter)
        }
        path = checkpoint.load(self, directory, **options)
        if hyperparameters_from_config:
            with torch.no_grad():
                own = loss_own_state(self.loss_module, self.model)
                for name, value in buffers.items():
                    own[name].copy_(value)
            self._apply_optimizer_config()
        return path

    def _apply_optimizer_config(self) -> None:
        """[optimizer] onto every param group; the schedule's factor at its current step."""
        o = self.config.optimizer
        for scheduler, optimizer in zip(
            self.lr_scheduler.schedulers, self.optimizer.optimizers, strict=True
        ):
            scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
            for index, group in enumerate(optimizer.param_groups):
                factor = scheduler.lr_lambdas[index](scheduler.last_epoch)
                group.update(
                    lr=o.lr * factor,
                    initial_lr=o.lr,
                    betas=tuple(o.betas),
                    eps=o.eps,
                    weight_decay=o.weight_decay,
                )

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore a `checkpoint()` from memory (reads nothing from disk; `load` does).

        A mid-window state restarts its accumulation window (with a warning).
        """
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(unpack_param_groups(state["optimizer"]))
        with warnings.catch_warnings():  # torch's scheduler calls get_lr() while loading
            warnings.filterwarnings("ignore", message="To get the last learning rate computed")
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        load_loss_own_state(self.loss_module, self.model, state["loss"])
        counters = dict(state["stepper"])
        accumulation = getattr(self.stepper, "gradient_accumulation_steps", 1)
        into_window = counters.get("micro_step", 0) % accumulation
        if into_window:
            warnings.warn(
                f"checkpoint was taken {into_window} micro-batch(es) into a gradient "
                "accumulation window; gradients are not saved, so the window restarts",
                stacklevel=2,
            )
            counters["micro_step"] -= into_window
        if hasattr(self.stepper, "load_counters") and counters:
            self.stepper.load_counters(counters)
        self.optimizer.zero_grad(set_to_none=True)
        self._window = WindowMetrics()
        self._normalization.reset()
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])

    def state_dict(self) -> dict[str, Any]:
        """The `Stateful` protocol (torch.distributed.checkpoint, TorchTitan's checkpointer):
        the same in-memory state as `checkpoint()`, so `dcp.save({"learner": learner}, ...)`
        works. Writes nothing to disk itself."""
        return self.checkpoint()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The `Stateful` protocol: restore what `state_dict()` returned (`load_checkpoint`)."""
        self.load_checkpoint(state_dict)

    @property
    def data_parallel_rank(self) -> int:
        """Which slice of the global batch this rank trains on (equal within a TP group)."""
        return (
            dist.get_rank(self.data_parallel_group) if self.data_parallel_group is not None else 0
        )

    def local_batch(self, global_batch: TensorDictBase) -> TensorDictBase:
        """This rank's contiguous 1/data_parallel_size slice of a batch every rank holds."""
        size = self.capabilities.data_parallel_size
        if global_batch.batch_size[0] % size:
            raise ValueError(
                f"global batch of {global_batch.batch_size[0]} sequences does not split evenly "
                f"over {size} data-parallel ranks"
            )
        per_rank = global_batch.batch_size[0] // size
        start = self.data_parallel_rank * per_rank
        return global_batch[start : start + per_rank]


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of tensors: DCP and cpu_offload may alias live shards, so never hand those out."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        elif isinstance(value, dict):
            out[key] = _clone(value)
        else:
            out[key] = value
    return out
