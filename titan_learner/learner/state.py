"""A learner's state in memory (`checkpoint` / `load_checkpoint`) and on disk (`save` / `load`).

Model and optimizer shards, LR scheduler, stepper counters, the loss module's own parameters
and buffers, step and policy version; gradients are not saved. Returned tensors are clones by
default: DCP and cpu_offload can alias live shards, so those are never handed out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_learner.checkpoint.packing import pack_param_groups, unpack_param_groups
from titan_learner.learner.optim.guards import load_loss_own_state, loss_own_state
from titan_learner.model.lora import checkpointed_state, load_checkpointed_state
from titan_learner.ranks import rank

if TYPE_CHECKING:
    from titan_learner.learner.contract import Learner


def checkpoint_state(learner: Learner, clone: bool = True) -> dict[str, Any]:
    """This rank's state, as cloned tensors (clone=False: see `Learner.checkpoint`)."""
    copy = clone_tensors if clone else dict
    stepper = learner.stepper
    counters = stepper.counters() if hasattr(stepper, "counters") else {}
    return {
        "model": copy(checkpointed_state(learner.model)),
        "optimizer": optimizer_state(learner.optimizer, copy),
        "lr_scheduler": learner.lr_scheduler.state_dict(),
        "loss": copy(loss_own_state(learner.loss_module, learner.model)),
        "stepper": counters,
        "step": learner.step,
        "policy_version": learner.policy_version,
    }


def optimizer_state(optimizer, copy: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Optimizer state (`copy`: cloned or not), without side effects on a learner that
    never stepped.

    TorchTitan materializes missing Adam state with a zero-lr step, which leaves `step` at 1
    and would make the next update differ from that of a learner never checkpointed:
    step 0 with zero moments is exactly a fresh Adam, so the count is put back.
    """
    fresh = not any(inner.state for inner in optimizer.optimizers)
    state = copy(optimizer.state_dict())
    if fresh:
        for inner in optimizer.optimizers:
            for param_state in inner.state.values():
                param_state["step"].zero_()
        for key, value in state.items():
            if key.endswith(".step") and isinstance(value, torch.Tensor):
                value.zero_()
    return pack_param_groups(state)  # one record instead of one per parameter and setting


def load_checkpoint_state(learner: Learner, state: dict[str, Any]) -> None:
    """Restore a `checkpoint_state`; a mid-window state restarts its accumulation window."""
    load_checkpointed_state(learner.model, state["model"])
    learner.optimizer.load_state_dict(unpack_param_groups(state["optimizer"]))
    with warnings.catch_warnings():  # torch's scheduler calls get_lr() while loading
        warnings.filterwarnings("ignore", message="To get the last learning rate computed")
        learner.lr_scheduler.load_state_dict(state["lr_scheduler"])
    load_loss_own_state(learner.loss_module, learner.model, state["loss"])
    counters = dict(state["stepper"])
    accumulation = getattr(learner.stepper, "gradient_accumulation_steps", 1)
    into_window = counters.get("micro_step", 0) % accumulation
    if into_window:
        warnings.warn(
            f"checkpoint was taken {into_window} micro-batch(es) into a gradient "
            "accumulation window; gradients are not saved, so the window restarts",
            stacklevel=3,
        )
        counters["micro_step"] -= into_window
    if hasattr(learner.stepper, "load_counters") and counters:
        learner.stepper.load_counters(counters)
    learner.optimizer.zero_grad(set_to_none=True)
    learner.restart_window()
    learner.step = int(state["step"])
    learner.policy_version = int(state["policy_version"])


def save(learner: Learner, directory: str, **options: Any) -> Any:
    """titan_learner.checkpoint.save, with rank 0 writing the resolved config and the model's
    architecture beside the steps (`directory/config.toml`, `model_config.json`)."""
    from titan_learner import checkpoint
    from titan_learner.checkpoint.layout import save_resolved_config
    from titan_learner.checkpoint.lora_base import record_base
    from titan_learner.model.architecture_record import record_architecture

    if rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        save_resolved_config(learner.config, directory)
        record_architecture(learner.spec, directory)
        if learner.base_fingerprint is not None:
            record_base(directory, learner.base_fingerprint, learner.config.model.hf_checkpoint)
    return checkpoint.save(learner, directory, **options)


def load(
    learner: Learner, directory: str, hyperparameters_from_config: bool, **options: Any
) -> Any:
    """titan_learner.checkpoint.load; hyperparameters_from_config=True puts the config's
    optimizer settings and loss buffers back over the checkpoint's. LoRA adapters load only
    onto the base they were trained on (checked before any record is read)."""
    from titan_learner import checkpoint
    from titan_learner.checkpoint.lora_base import check_base

    if learner.base_fingerprint is not None:
        check_base(directory, learner.base_fingerprint, learner.config.model.hf_checkpoint)

    own = loss_own_state(learner.loss_module, learner.model)
    buffers = {  # the config's values, kept only when they are to win over the checkpoint's
        name: tensor.detach().clone()
        for name, tensor in own.items()
        if hyperparameters_from_config and not isinstance(tensor, nn.Parameter)
    }
    path = checkpoint.load(learner, directory, **options)
    if hyperparameters_from_config:
        with torch.no_grad():
            own = loss_own_state(learner.loss_module, learner.model)
            for name, value in buffers.items():
                own[name].copy_(value)
        apply_optimizer_config(learner)
    return path


def apply_optimizer_config(learner: Learner) -> None:
    """[optimizer] onto every param group; the schedule's factor at its current step."""
    o = learner.config.optimizer
    for scheduler, optimizer in zip(
        learner.lr_scheduler.schedulers, learner.optimizer.optimizers, strict=True
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


def clone_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of tensors: DCP and cpu_offload may alias live shards, so never hand those out."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        elif isinstance(value, dict):
            out[key] = clone_tensors(value)
        else:
            out[key] = value
    return out
