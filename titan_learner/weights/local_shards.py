"""The learner's weights as Hugging Face-named shards that each rank already holds: no gather.

vLLM's `nccl_m2n` weight transfer reshards every trainer rank's shard straight into the
rollout servers' tensor-parallel layout, so it needs each Hugging Face tensor as this rank's
shard plus where the shards lie (a mesh of the trainer's ranks, and per mesh axis the tensor
dim it splits or `REPLICATE`). TorchTitan names and lays out tensors its own way: most become
Hugging Face tensors by a rename, attention weights by a row gather (Llama's q/k RoPE
permutation moves rows within a head; a fused QKV split takes row blocks). A row gather stays
local when every Hugging Face shard's rows come from the same rank's TorchTitan shard (shards
of whole heads). A tensor whose conversion crosses shards, or whose layout m2n cannot express
(uneven shards, more shards than m2n lets feed one destination shard, both mesh axes sharded,
FSDP over TP's strided shards, another mesh), is gathered and sent whole from every rank:
correct, at the cost of that tensor's gather.

The plan is made once, from shapes and placements alone, so it is the same on every rank; it
finds each conversion's rows by running TorchTitan's own conversion on a tensor of row indices.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_learner.weights.export import ToStateDict, titan_parameters
from titan_learner.weights.lora import uses_lora

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

REPLICATE = -1
"""A mesh axis that holds the whole tensor (vLLM's m2n code); another code is the dim it splits."""
Placements = tuple[int, int]
MeshDims = tuple[int, int]
RowMap = torch.Tensor | bool | None
"""The TorchTitan rows a Hugging Face tensor takes, in order; None: all (a rename); False: it is
not a gather of whole rows."""


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One Hugging Face tensor: what every rank sends of it."""

    name: str
    shape: tuple[int, ...]
    """The whole tensor's."""
    placements: Placements | None
    """Over the source mesh; None: every rank sends the whole tensor, made from the whole
    parameter (all-gathered where it is sharded, as it is where every rank holds all of it)."""
    rows: torch.Tensor | None
    """This rank's rows of its own TorchTitan shard, in Hugging Face order (None: all, as they
    are). Unused where the tensor is sent whole."""


@dataclasses.dataclass(frozen=True)
class _Parameter:
    param: torch.Tensor
    to_hf: ToStateDict
    """A whole copy of the parameter -> its Hugging Face tensors."""
    plans: tuple[ShardPlan, ...]


class LocalShards:
    """Every rank's Hugging Face-named shards of `model`, cast to `dtype`, and their layout.

    `mesh_dims`: the trainer's ranks as m2n sees them (rank r at row-major position r);
    iterating is a collective where any tensor is gathered, so every rank iterates.
    `max_sources`: the most source shards m2n lets feed one destination shard (vLLM's
    `MAX_SOURCE_SHARDS`, which titan_learner.vllm.m2n_source reads: vllm stays in vllm/).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        dtype: torch.dtype,
        world_size: int,
        *,
        max_sources: int,
    ):
        if uses_lora(model):  # the config check refuses it first (vllm.checks)
            raise ValueError(
                "local shards cannot carry a LoRA model's merged weights (W + alpha/rank B A "
                "needs the whole adapters); allowed: a gathered export (iter_weights)"
            )
        adapter = spec.state_dict_adapter(spec.model, None)
        self.dtype = dtype
        self.mesh_dims = _source_mesh(model, world_size)
        rows_of: dict[tuple[str, tuple[int, ...]], list[RowMap]] = {}
        self._parameters: list[_Parameter] = []
        for name, param, to_state_dict in titan_parameters(model):

            def to_hf(full: torch.Tensor, split: ToStateDict = to_state_dict) -> dict:
                return adapter.to_hf(split(full))

            shape = tuple(param.shape)
            key = (re.sub(r"\d+", "{}", name, count=1), shape)  # layers share their conversion
            if key not in rows_of:
                rows_of[key] = _row_maps(to_hf, shape)
            whole = to_hf(torch.empty(shape, device="meta"))
            plans = tuple(
                _plan(hf_name, tuple(meta.shape), param, rows, self.mesh_dims, max_sources)
                for (hf_name, meta), rows in zip(whole.items(), rows_of[key], strict=True)
            )
            self._parameters.append(_Parameter(param, to_hf, plans))

    @property
    def plans(self) -> list[ShardPlan]:
        return [plan for parameter in self._parameters for plan in parameter.plans]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, this rank's shard) in `plans` order; may alias live weights, so
        send them before the learner's next update.

        One parameter at a time: what was made for the one before (gathered, cast) is let go
        before the next gather, so a consumer that drops each tensor once it is sent never
        holds more than one parameter's."""
        for parameter in self._parameters:
            param = parameter.param
            local = param.to_local() if isinstance(param, DTensor) else param
            made = {}
            if any(plan.placements is None for plan in parameter.plans):
                made = parameter.to_hf(param.full_tensor() if isinstance(param, DTensor) else param)
            for plan in parameter.plans:
                yield plan.name, self._sent(plan, local, made)

    def _sent(self, plan: ShardPlan, local: torch.Tensor, made: dict) -> torch.Tensor:
        """What `plan` sends, from this rank's shard `local` or the Hugging Face tensors `made`
        of the whole parameter (taken out: nothing keeps it once it is sent)."""
        if plan.placements is None:
            tensor = made.pop(plan.name)
        elif plan.rows is None:
            tensor = local
        else:
            tensor = local.index_select(0, plan.rows)
        return tensor.detach().to(self.dtype).contiguous()


def _source_mesh(model: nn.Module, world_size: int) -> MeshDims:
    """The mesh of the first sharded parameter that m2n can take; (world_size, 1) if none."""
    for _, param, _ in titan_parameters(model):
        dims = _mesh_dims(param, world_size)
        if dims is not None and any(code != REPLICATE for code in _codes(param)):
            return dims
    return (world_size, 1)


def _mesh_dims(param: torch.Tensor, world_size: int) -> MeshDims | None:
    """A DTensor's mesh as m2n's (rows, cols) over ranks 0..world_size-1 in order, or None."""
    if not isinstance(param, DTensor):
        return None
    grid = param.device_mesh.mesh
    if grid.ndim > 2 or grid.flatten().tolist() != list(range(world_size)):
        return None
    return (grid.shape[0], grid.shape[1] if grid.ndim == 2 else 1)


def _row_maps(to_hf: ToStateDict, shape: tuple[int, ...]) -> list[RowMap]:
    """The row map of each Hugging Face tensor `to_hf` makes of a parameter of `shape`."""
    index = torch.int32 if shape[0] < 2**31 else torch.int64
    probe = torch.arange(shape[0], dtype=index).view(-1, *[1] * (len(shape) - 1)).expand(shape)
    maps: list[RowMap] = []
    for made in to_hf(probe).values():
        if made.data_ptr() == probe.data_ptr() and made.stride() == probe.stride():
            maps.append(None if tuple(made.shape) == shape else False)
            continue
        if made.dim() != len(shape) or tuple(made.shape[1:]) != shape[1:]:
            maps.append(False)
            continue
        rows = made[(slice(None),) + (0,) * (made.dim() - 1)]
        same = torch.equal(made, rows.view(-1, *[1] * (made.dim() - 1)).expand(made.shape))
        maps.append(rows.long() if same else False)
    return maps


def _plan(
    name: str,
    shape: tuple[int, ...],
    param: torch.Tensor,
    rows: RowMap,
    mesh_dims: MeshDims,
    max_sources: int,
) -> ShardPlan:
    gathered = ShardPlan(name, shape, None, None)
    if not isinstance(param, DTensor):
        return gathered  # every rank holds all of it: nothing to gather
    codes = _codes(param)
    if all(code == REPLICATE for code in codes):
        return gathered  # as above
    if rows is False or _mesh_dims(param, mesh_dims[0] * mesh_dims[1]) != mesh_dims:
        return gathered
    if None in codes or sum(code != REPLICATE for code in codes) != 1:
        return gathered
    placements: Placements = (codes[0], REPLICATE) if len(codes) == 1 else (codes[0], codes[1])
    axis = next(a for a, c in enumerate(placements) if c != REPLICATE)
    dim, factor = placements[axis], mesh_dims[axis]
    if not _m2n_splits(shape[dim], param.shape[dim], factor, max_sources):
        return gathered
    if rows is None or dim != 0:
        on_device = None if rows is None else rows.to(param.device)
        return ShardPlan(name, shape, placements, on_device)
    ours, theirs = param.shape[0] // factor, shape[0] // factor
    chunks = rows.view(factor, theirs) - torch.arange(factor).view(-1, 1) * ours
    if bool(((chunks < 0) | (chunks >= ours)).any()):
        return gathered  # a Hugging Face shard takes rows from another rank's shard
    coordinate = param.device_mesh.get_coordinate()
    ours = chunks[coordinate[axis]].to(param.device)
    return ShardPlan(name, shape, placements, ours)


def _m2n_splits(whole: int, ours: int, shards: int, max_sources: int) -> bool:
    """Whether m2n takes a dim of size `whole` (`ours` in the TorchTitan parameter) as `shards`
    source shards: even ones, and no more than m2n lets feed one destination shard.

    vLLM's workers refuse more than `max_sources` into a replicated destination at their
    init (`check_plan_limits`), while the trainer ranks wait in the communicator's init for
    workers that never join. A destination the workers split by tensor parallelism is not
    checked there, but m2n's own bound is the same and a row-parallel one (split on the input
    dim, where FSDP splits the rows) takes every source shard. The workers choose destinations
    per server, after the plan is made, so the source's count alone decides."""
    return shards <= max_sources and whole % shards == 0 and ours % shards == 0


def _codes(param: DTensor) -> list[int | None]:
    sizes = param.device_mesh.shape
    return [_code(p, n) for p, n in zip(param.placements, sizes, strict=True)]


def _code(placement, axis_size: int) -> int | None:
    """m2n's code for a placement on a mesh axis of `axis_size` ranks (None: none fits); an
    axis of one rank holds the whole tensor whatever it says."""
    if axis_size == 1:
        return REPLICATE
    if type(placement) is Shard:
        return placement.dim
    return REPLICATE if type(placement) is Replicate else None
