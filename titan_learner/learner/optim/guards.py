"""Guards of the Learner contract: what must be true of the optimizer and the loss module.

- Every parameter that receives a gradient is optimized ("the critic never trains" mistake).
- A loss module's own trainable parameters would not be gradient-synchronized under data
  parallelism (FSDP synchronizes the model's), so they are rejected there.
- The loss module's own parameters and buffers are part of the learner's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class OptimizerCoverageCheck:
    """Before the first optimizer step: every parameter with a gradient must be optimized.

    Catches the "critic never trains" mistake: a loss-owned or extra module whose parameters
    receive gradients but sit in no optimizer param group would silently never change.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, modules: Callable[[], list[nn.Module]]
    ) -> None:
        self.modules = modules
        self.handle = optimizer.register_step_pre_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.handle.remove()
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        orphans = sorted(
            name
            for module in self.modules()
            for name, p in module.named_parameters()
            if p.grad is not None and id(p) not in optimized
        )
        if orphans:
            raise RuntimeError(
                f"{len(orphans)} parameter(s) received gradients but are in no optimizer param "
                f"group, so they would never train: {', '.join(orphans[:5])}. Add them to the "
                "optimizer or set requires_grad=False."
            )


def loss_own_state(loss_module: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers that belong to the loss itself, not to the policy model."""
    model_ids = {id(t) for t in (*model.parameters(), *model.buffers())}
    return {
        name: t
        for name, t in (*loss_module.named_parameters(), *loss_module.named_buffers())
        if id(t) not in model_ids
    }


def reject_unsynchronized_loss_parameters(
    loss_module: nn.Module, model: nn.Module, data_parallel_size: int
) -> None:
    """A trainable parameter of the loss itself would get a different gradient on every
    data-parallel rank (FSDP synchronizes the model's gradients only), so ranks would drift."""
    if data_parallel_size == 1:
        return
    own = loss_own_state(loss_module, model)
    trainable = sorted(n for n, t in own.items() if isinstance(t, nn.Parameter) and t.requires_grad)
    if trainable:
        raise ValueError(
            f"the loss module has trainable parameters of its own ({', '.join(trainable[:5])}); "
            f"with {data_parallel_size} data-parallel ranks their gradients would "
            "not be synchronized. Allowed: loss parameters with requires_grad=False (buffers), "
            "or one data-parallel rank"
        )


@torch.no_grad()
def load_loss_own_state(loss_module: nn.Module, model: nn.Module, saved: dict) -> None:
    own = loss_own_state(loss_module, model)
    if set(saved) != set(own):
        raise KeyError(
            f"checkpoint loss state {sorted(saved)} does not match this loss's own "
            f"parameters and buffers {sorted(own)}"
        )
    for name, tensor in own.items():
        tensor.copy_(saved[name])
