"""Adam and AdamW that step each rank's local shards of DTensor parameters, and TorchTitan's
optimizers container that builds them.

TorchTitan's optimizers step FSDP's (and TP's) DTensor parameters, so every foreach operator of
the update goes through DTensor's dispatch: sharding propagation and wrapping for each of a
dozen operators a step, whatever the model size. Adam is elementwise, and a parameter, its
gradient and its two moments share one layout, so the same update on the local tensors is the
same arithmetic on the same numbers: bit for bit the DTensor result, in 0.68-0.73x the time of the
DTensor step on the 0.08 M model on a CPU (`docs/performance.md`). The optimizer's state stays the
DTensors upstream creates, so checkpoints, their resharding and `load_state_dict` see no
difference.

A group whose tensors are not all in one layout per parameter (a gradient placed differently
from its parameter, complex parameters, `differentiable=True`) takes upstream's step unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torchtitan.components.optimizer import OptimizersContainer


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (no autograd: optimizer state), a plain tensor as is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _same_layout(param: Tensor, others: list[Tensor]) -> bool:
    """Whether every tensor of `others` is laid out as `param` is (the update is elementwise
    on the local tensors only then)."""
    if not isinstance(param, DTensor):
        return not any(isinstance(t, DTensor) for t in others)
    mesh, placements = param.device_mesh, param.placements
    return all(
        isinstance(t, DTensor)
        and t.placements == placements
        and (t.device_mesh is mesh or t.device_mesh == mesh)
        for t in others
    )


def local_shards(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
) -> tuple[list[Tensor], ...] | None:
    """The local tensors of the parameters, gradients and moments (`max_exp_avg_sqs` is empty
    without amsgrad), or None when some parameter's tensors are laid out differently."""
    for i, param in enumerate(params):
        others = [grads[i], exp_avgs[i], exp_avg_sqs[i], *max_exp_avg_sqs[i : i + 1]]
        if not _same_layout(param, others):
            return None
    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    return tuple([local_tensor(t) for t in tensors] for tensors in lists)


class LocalShardAdam(torch.optim.Adam):
    """torch.optim.Adam whose update runs on the local shards (bit-identical, see the module)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self.defaults["differentiable"]:
            return super().step(closure)
        self._accelerator_graph_capture_health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        """Upstream's step of one group: its lazy state initialization, then `adam` on the
        local tensors when their layouts allow it, on the DTensors otherwise."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        state_steps: list[Tensor] = []
        has_complex = self._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
        tensors = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        local = None if has_complex else local_shards(*tensors)
        beta1, beta2 = group["betas"]
        adam(
            *(local or tensors),
            state_steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


class LocalShardAdamW(LocalShardAdam, torch.optim.AdamW):
    """torch.optim.AdamW (Adam with decoupled weight decay) stepping the local shards."""


def torch_step(container: OptimizersContainer) -> Callable[[], None]:
    """A step of each of `container`'s optimizers by torch's own class (on the DTensors, as
    TorchTitan's container steps them): the baseline the benchmarks measure against."""
    steps = []
    for optimizer in container.optimizers:
        upstream = next(
            c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")
        )
        steps.append(functools.partial(upstream.step, optimizer))

    def step() -> None:
        for each in steps:
            each()

    return step


class LocalShardOptimizersContainer(OptimizersContainer):
    """TorchTitan's OptimizersContainer whose Adam and AdamW step the local shards."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        local = {"Adam": LocalShardAdam, "AdamW": LocalShardAdamW}
        return local.get(name) or OptimizersContainer._resolve_optimizer_factory(name)
