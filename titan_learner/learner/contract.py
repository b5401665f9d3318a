"""The Learner contract: train_step / update, weights out, checkpoint state in and out.

`Learner` holds the contract once; `LocalLearner` (one process, plain model: the reference every
parity test compares against) and `TitanLearner` (TorchTitan-built and -sharded) differ only in
how they build the model and which process groups they reduce over. A facade: what the stepper
calls back is `learner.step`, the state in and out `learner.state`, the parts sub-packages.

Collectives: `train_step`, `update`, `checkpoint`, `load_checkpoint` and `get_weights` must be
called by every rank of the world, the same number of times, in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn

from titan_learner.config.schema import Config
from titan_learner.dtypes import DTYPES
from titan_learner.learner import state
from titan_learner.learner.batch import REF_LOG_PROBS_KEY
from titan_learner.learner.forward.policy import TitanPolicy
from titan_learner.learner.loss.classes import build_loss
from titan_learner.learner.loss.normalization import aggregation_kind, step_counts
from titan_learner.learner.optim.guards import (
    OptimizerCoverageCheck,
    reject_unsynchronized_loss_parameters,
)
from titan_learner.learner.optim.optimizer import build_lr_scheduler, build_optimizer
from titan_learner.learner.optim.stepper import adopt_stepper
from titan_learner.learner.reference_scoring import Reference, with_reference_log_probs
from titan_learner.learner.step import StepperTrainer
from titan_learner.ranks import rank
from titan_learner.weights.export import DEFAULT_BUCKET_BYTES, WeightExport, iter_hf_tensors
from titan_learner.weights.peft import iter_peft_tensors

if TYPE_CHECKING:
    from torchrl.trainers.trainers import OptimizationStepper
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


class Learner(StepperTrainer):
    """A policy model, a TorchRL loss and a TorchRL optimization stepper behind one contract;
    the stepper's trainer (`compute_loss`, ...) is its base, titan_learner.learner.step."""

    parallel_dims: ParallelDims | None = None  # TorchTitan's mesh; None for LocalLearner
    base_fingerprint: str | None = None  # LoRA: the base its adapters fit (model.lora)

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
        optimizer = build_optimizer(model, config, device.type)
        self.lr_scheduler = build_lr_scheduler(optimizer, config)
        self.stepper = adopt_stepper(
            stepper,
            optimizer,
            model=model,
            learner=config.learner,
            clip_norm=self.clip_norm,
            device_type=device.type,
        )
        self.optimizer = self.stepper.optimizer
        self._coverage = OptimizerCoverageCheck(
            self.optimizer, lambda: [self.model, self.loss_module]
        )
        self.step = 0
        self.policy_version = 0
        self.vocab_size = model.config.vocab_size
        self.restart_window()

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
        `train_step` takes (whole under a token budget). A collective. For callers that need them before the step (a KL in the reward changes the advantages;
        `mask_truncated` drops rows): `train_step` then keeps the ones the batch carries."""
        budget = self.config.learner.max_tokens_per_microbatch
        parts = 1 if budget else self.config.learner.grad_accum_steps
        return with_reference_log_probs(rank_batch, reference, parts)

    def iter_weights(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        cpu_offload: bool = True,
        checksum: bool = True,
        adapters: bool = False,
    ) -> WeightExport:
        """Stream the weights as buckets of (Hugging Face name, full plain tensor); adapters=True:
        a LoRA model's adapters alone, under PEFT's names (weights.peft).

        A collective: every rank iterates to the end. Extra memory per rank is about one bucket.
        cpu_offload=True: CPU tensors on rank 0, empty buckets elsewhere; False: tensors on the
        learner's device on every rank. dtype defaults to [learner] export_dtype. The returned
        export's `manifest` (names, shapes, dtypes, version, checksum) is set once iterated.
        checksum=False skips hashing the bytes (a device-to-host copy of every tensor on GPU)
        where they never leave the process; names and shapes are still in the manifest."""
        return WeightExport(
            (iter_peft_tensors if adapters else iter_hf_tensors)(self.model, self.spec),
            version=self.policy_version,
            bucket_bytes=bucket_bytes,
            dtype=dtype or DTYPES[self.config.learner.export_dtype],
            device=torch.device("cpu") if cpu_offload else self.device,
            keep=not cpu_offload or rank() == 0,
            checksum=checksum,
        )

    @torch.no_grad()
    def get_weights(self, cpu_offload: bool = True, dtype: torch.dtype | None = None) -> TensorDict:
        """All weights as one flat TensorDict keyed by Hugging Face name (see iter_weights).
        cpu_offload=True: CPU copies on rank 0, an empty TensorDict on other ranks; False: full
        tensors on the learner's device, on every rank."""
        export = self.iter_weights(
            bucket_bytes=2**62, dtype=dtype, cpu_offload=cpu_offload, checksum=False
        )
        return TensorDict(dict(pair for bucket in export for pair in bucket), batch_size=[])

    def checkpoint(self, *, clone: bool = True) -> dict[str, Any]:
        """This rank's state in memory, cloned (a collective on sharded learners; `save`
        writes it to disk). Gradients are not saved. clone=False: the tensors as the model's
        and optimizer's `state_dict()` return them (live, or derived by a state-dict hook as
        TorchTitan's fused QKV split does): what a load fills in place before `load_checkpoint`
        and a synchronous save writes from, without a copy. Never keep it."""
        return state.checkpoint_state(self, clone)

    def load_checkpoint(self, saved: dict[str, Any]) -> None:
        """Restore a `checkpoint()` from memory (reads nothing from disk; `load` does).
        A mid-window state restarts its accumulation window (with a warning)."""
        state.load_checkpoint_state(self, saved)

    def save(self, directory: str, **options: Any) -> Any:
        """Write a DCP checkpoint (a collective): titan_learner.checkpoint.save. Rank 0 also
        writes the resolved config and the model's architecture beside the steps, so a
        checkpoint says which model it holds (`python -m titan_learner export` reads them)."""
        return state.save(self, directory, **options)

    def load(
        self, directory: str, *, hyperparameters_from_config: bool = False, **options: Any
    ) -> Any:
        """Restore a DCP checkpoint (a collective): titan_learner.checkpoint.load.
        hyperparameters_from_config=True: the optimizer's lr, betas, eps and weight decay and
        the loss's own buffers (e.g. its clip bounds) follow this learner's config, not the
        checkpoint; the learning-rate schedule keeps its position (the step)."""
        return state.load(self, directory, hyperparameters_from_config, **options)

    def state_dict(self) -> dict[str, Any]:
        """The `Stateful` protocol (DCP, TorchTitan's checkpointer): `checkpoint()`'s state, so
        `dcp.save({"learner": learner}, ...)` works. Writes nothing to disk itself."""
        return self.checkpoint()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The `Stateful` protocol: restore what `state_dict()` returned (`load_checkpoint`)."""
        self.load_checkpoint(state_dict)

    @property
    def data_parallel_rank(self) -> int:
        """Which slice of the global batch this rank trains on (equal within a TP group)."""
        group = self.data_parallel_group
        return dist.get_rank(group) if group is not None else 0

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
