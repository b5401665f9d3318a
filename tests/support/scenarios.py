"""What each rank of a test world runs: build a TitanLearner per layout, update, gather.

Importable by spawned processes (they unpickle these functions by module name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tests.support.models import batches, tiny_config, with_ref_log_probs
from titan_learner.learner.loss.normalization import step_counts
from titan_learner.learner.titan import TitanLearner
from titan_learner.weights.export import unwrapped_name
from titan_learner.weights.lora import is_adapter

STEPS = 3
LORA = {"rank": 4, "alpha": 8.0}
"""[model.lora] of the LoRA layouts: every Linear but the output head, scale 2."""


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A full copy of a (DTensor-sharded) tensor: a collective where it is sharded."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def capture_gradients(learner) -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's gradients as the optimizer sees them (reduced over ranks and
    clipped), whole, by parameter name: appended to the returned list at every step."""
    names = {id(p): unwrapped_name(n) for n, p in learner.model.named_parameters()}
    captured: list[dict[str, torch.Tensor]] = []

    def hook(optimizer, args, kwargs) -> None:
        captured.append(
            {
                names[id(p)]: whole(p.grad)
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            }
        )

    for inner in learner.optimizer.optimizers:
        inner.register_step_pre_hook(hook)
    return captured


def frozen_base(learner) -> dict[str, torch.Tensor]:
    """Every parameter but the LoRA adapters, whole (a collective on sharded learners)."""
    return {
        unwrapped_name(n): whole(p)
        for n, p in learner.model.named_parameters()
        if not is_adapter(n)
    }


def lora_checks(learner, base_before: dict, gradients: list) -> dict[str, Any]:
    """What a LoRA layout reports besides metrics and weights: the adapter gradients of each
    step, whether the frozen base is bit-identical to its start, what the optimizer holds."""
    base_after = frozen_base(learner)
    optimized = {
        id(p)
        for inner in learner.optimizer.optimizers
        for g in inner.param_groups
        for p in g["params"]
    }
    trained = [unwrapped_name(n) for n, p in learner.model.named_parameters() if id(p) in optimized]
    return {
        "gradients": gradients,
        "base_unchanged": base_before.keys() == base_after.keys()
        and all(torch.equal(base_before[k], base_after[k]) for k in base_before),
        "optimized": sorted(trained),
    }


def train_layout(
    sections: dict,
    steps: int = STEPS,
    accumulate: bool = False,
    model: str = "llama3",
    varied: bool = False,
    grouped: bool = False,
    poisoned_step: int | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    """STEPS updates on the shared synthetic batches; metrics on every rank, weights on rank 0.

    accumulate=True feeds each rank's batch as two micro-batches with grad_accum_steps=2 (of
    unequal sizes, 1/4 and 3/4 of the rows, when varied); varied=True: rows train different
    numbers of tokens (`synthetic_batch(varied=True)`), and every micro-batch gets the
    window's `step_counts` (otherwise its halves are normalized alone, per_microbatch_mean);
    grouped=True: rows in groups sharing a prompt, as rollouts are.
    poisoned_step=i: rank 0's advantages are NaN at step i (a non-finite loss on one rank).
    save_to: a checkpoint root the learner saves into after its steps.
    """
    config = tiny_config(model, **sections)
    learner = TitanLearner.from_config(config)
    lora = config.model.lora is not None
    if lora:
        base_before, gradients = frozen_base(learner), capture_gradients(learner)
    needs_ref = bool(config.loss.kwargs.get("kl_to_ref_coeff"))
    metrics = []
    for step, batch in enumerate(batches(steps, varied=varied, grouped=grouped)):
        local = learner.local_batch(with_ref_log_probs(batch) if needs_ref else batch)
        if step == poisoned_step and torch.distributed.get_rank() == 0:
            local["advantage"] = torch.full_like(local["advantage"], float("nan"))
        if accumulate:
            cut = max(1, local.batch_size[0] // 4) if varied else local.batch_size[0] // 2
            micros = [local[:cut], local[cut:]]
            counts = step_counts(micros) if varied else None
            for micro in micros:  # equal halves: their own means make the step's mean
                out = learner.update(micro, step_counts=counts, per_microbatch_mean=not varied)
            metrics.append(dict(out.items()))
        else:
            metrics.append(dict(learner.update(local).items()))
    if save_to is not None:
        learner.save(save_to)
    weights = learner.get_weights(dtype=torch.float32)
    # Exported tensors are copies: changing them leaves the learner alone (a collective re-export).
    originals = {k: v.clone() for k, v in weights.items()}
    for tensor in weights.values():
        tensor.add_(1.0)
    again = learner.get_weights(dtype=torch.float32)
    assert all(torch.equal(again[k], v) for k, v in originals.items()), "export aliases weights"
    weights = originals
    return {
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
        "weights": {k: v.clone() for k, v in weights.items()},
        "capabilities": learner.capabilities,
        **(lora_checks(learner, base_before, gradients) if lora else {}),
    }


def run_layouts(rank: int, layouts: dict[str, dict]) -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: train_layout(**spec) for name, spec in layouts.items()}


def loss_parameter_rejected(rank: int) -> str:
    """A loss with its own trainable parameter on dp_shard=2: construction must refuse it."""
    from torch import nn

    class LearnedCoefficient(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    config = tiny_config(parallelism={"dp_shard": 2})
    try:
        TitanLearner.from_config(config, loss_module=LearnedCoefficient())
    except ValueError as err:
        return str(err)
    return "accepted"
