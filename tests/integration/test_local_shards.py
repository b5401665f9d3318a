"""What `nccl_m2n` sends: each rank's Hugging Face-named shards (`weights.local_shards`) must
reassemble, under the layout they declare, into exactly the learner's gathered export, on real
gloo worlds of 2 and 4; tensors whose shards are local must not be gathered, and the layout
must pass vLLM's own m2n validation (what its trainer engine checks before any NCCL call)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.support.models import batches, tiny_config
from tests.support.vllm import needs_vllm
from tests.support.worlds import run_world

pytestmark = needs_vllm

# name -> (model, [model.overrides] beyond tiny_config's, [parallelism])
WORLD2 = {
    "llama3 dp_shard=2": ("llama3", {}, {"dp_shard": 2}),
    "llama3 one KV head dp_shard=2": ("llama3", {"n_kv_heads": 1}, {"dp_shard": 2}),
    "llama3 tp=2": ("llama3", {}, {"tp": 2, "dp_shard": 1}),
    "llama3 dp_replicate=2": ("llama3", {}, {"dp_replicate": 2, "dp_shard": 1}),
    "qwen3 dp_shard=2": ("qwen3", {}, {"dp_shard": 2}),
}
WORLD4 = {
    "llama3 HSDP 2x2": ("llama3", {}, {"dp_replicate": 2, "dp_shard": 2}),
    "qwen3 dp_shard=2 x tp=2": ("qwen3", {}, {"dp_shard": 2, "tp": 2}),
}
F32, BF16 = torch.float32, torch.bfloat16


def reassembled(plan, local: torch.Tensor, mesh_dims: tuple[int, int]) -> torch.Tensor:
    """The whole tensor from every rank's shard, as the plan's placements say m2n lays it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if plan.placements is None:
        return local
    mesh = DeviceMesh("cpu", torch.arange(mesh_dims[0] * mesh_dims[1]).view(mesh_dims))
    placements = [Replicate() if code < 0 else Shard(code) for code in plan.placements]
    return DTensor.from_local(local, mesh, placements, run_check=False).full_tensor()


def vllm_accepts(source) -> None:
    """vLLM's own init-time checks of a trainer's m2n layout (M2NTrainerWeightTransferEngine)."""
    from vllm.distributed.weight_transfer.m2n_common import (
        check_transferable,
        resolve_layout,
        validate_layout,
    )

    mesh = source.mesh()
    for meta in source.metadata():
        check_transferable(meta.name, meta.dtype, meta.shape)
        validate_layout(*resolve_layout(mesh, meta.placements), meta.shape, "source")


def sent_lazily(source, model) -> tuple[list, list[str]]:
    """What `source` gives on each of two sends (two servers), as vLLM's engine iterates it,
    and what it gave out before that was still alive at a gather (to a consumer that lets
    each tensor go once it is sent).

    The gathers are watched where they run, in the dispatcher (they run as they would anyway);
    a tensor sharing a live weight's storage is no copy and is left out."""
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }
    given: list[tuple[str, StorageWeakRef]] = []
    kept: list[str] = []

    class AtGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_gather" in func.__name__:
                kept.extend(name for name, ref in given if not let_go(ref))
            return func(*args, **(kwargs or {}))

    sends = []
    with AtGathers():
        for send in range(2):
            sent = []
            for name, tensor in source:
                if tensor.untyped_storage().data_ptr() not in weights:
                    given.append((f"send {send}: {name}", StorageWeakRef(tensor.untyped_storage())))
                sent.append((name, tensor.clone()))
                del tensor
            sends.append(sent)
    return sends, kept


def let_go(ref, seconds: float = 1.0) -> bool:
    """Whether the storage `ref` watches is freed within `seconds`: gloo's worker thread lets go
    of a collective's tensors a moment after the rank waiting on it goes on."""
    deadline = time.monotonic() + seconds
    while not ref.expired():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def check_layouts(rank: int, layouts: dict) -> dict:
    import torch.distributed as dist

    from titan_learner.learner.titan import TitanLearner
    from titan_learner.vllm.m2n_source import ShardSource, local_shards

    results = {}
    for case, (name, shape, parallelism) in layouts.items():
        torch.manual_seed(0)
        config = tiny_config(name, parallelism=parallelism)
        if shape:  # tiny_config's shape, changed
            overrides = {**dataclasses.asdict(config.model.overrides), **shape}
            config = tiny_config(name, parallelism=parallelism, model={"overrides": overrides})
        learner = TitanLearner.from_config(config)
        learner.update(batches(1, varied=True)[0])  # weights that differ from their init
        for dtype in (F32, BF16):
            exported = dict(learner.get_weights(cpu_offload=False, dtype=dtype).items())
            shards = local_shards(learner.model, learner.spec, dtype, dist.get_world_size())
            sent_listed = list(shards)  # all at once, as it was sent before
            names = [plan.name for plan in shards.plans]
            assert [n for n, _ in sent_listed] == names, case
            whole = {}
            for plan, (_, local) in zip(shards.plans, sent_listed, strict=True):
                assert local.dtype == dtype and local.is_contiguous(), (case, plan.name)
                whole[plan.name] = reassembled(plan, local, shards.mesh_dims)
            source = ShardSource(shards)
            vllm_accepts(source)
            sends, kept = sent_lazily(source, learner.model)
            results[(case, str(dtype))] = {
                "lazy_as_listed": [
                    [n for n, _ in sent] == names
                    and all(
                        t.dtype == e.dtype and torch.equal(t, e)
                        for (_, t), (_, e) in zip(sent, sent_listed, strict=True)
                    )
                    for sent in sends
                ],
                "kept_at_a_gather": kept,
                "names": names,
                "exported": list(exported),
                "equal": sorted(n for n in names if torch.equal(whole[n], exported[n])),
                "layout": {p.name: p.placements for p in shards.plans},  # None: sent whole
                "mesh": source.mesh().dims,
            }
    return results


@pytest.fixture(scope="module")
def world2():
    return run_world(2, check_layouts, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_world(4, check_layouts, WORLD4)


def results_of(world: list[dict], case: str) -> list[dict]:
    return [world[0][(case, str(F32))], world[0][(case, str(BF16))]]


def tied_alias(case: str) -> set[str]:
    return {"lm_head.weight"} if case.startswith("qwen3") else set()  # qwen3 tiny ties


@pytest.mark.parametrize("case", [*WORLD2, *WORLD4])
def test_every_ranks_shards_reassemble_into_the_gathered_export(world2, world4, case):
    world = world2 if case in WORLD2 else world4
    for result in results_of(world, case):
        # the export's order, less the alias a tied model's served copy does not load
        assert result["names"] == [n for n in result["exported"] if n not in tied_alias(case)]
        assert result["equal"] == sorted(result["names"])  # bit for bit, in fp32 and bf16


def test_fsdp_sends_every_tensor_from_its_own_shard(world2):
    for result in results_of(world2, "llama3 dp_shard=2"):
        assert result["mesh"] == (2, 1)
        assert set(result["layout"].values()) == {(0, -1)}  # no gather at all


def test_a_permutation_that_crosses_shards_is_gathered_and_only_it(world2):
    """One KV head: fused QKV's 96 rows split 48/48 cut q's heads apart from k and v."""
    for result in results_of(world2, "llama3 one KV head dp_shard=2"):
        layout = result["layout"]
        whole = {name for name, placements in layout.items() if placements is None}
        assert whole == {
            f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkv"
        }
        assert {layout[n] for n in layout if n not in whole} == {(0, -1)}


def test_tensor_parallel_shards_go_as_they_are_and_replicated_norms_whole(world2):
    for result in results_of(world2, "llama3 tp=2"):
        layout = result["layout"]
        assert result["mesh"] == (1, 2)
        for name, placements in layout.items():
            if "norm" in name:
                assert placements is None, name
            elif "o_proj" in name or "down_proj" in name:
                assert placements == (-1, 1), name  # row-parallel: split on the input dim
            else:
                assert placements == (-1, 0), name


def test_replicated_and_hybrid_layouts(world2, world4):
    for result in results_of(world2, "llama3 dp_replicate=2"):
        assert set(result["layout"].values()) == {None}  # every rank holds it all
    for result in results_of(world4, "llama3 HSDP 2x2"):
        assert result["mesh"] == (2, 2)
        assert set(result["layout"].values()) == {(-1, 0)}


def test_fsdp_over_tensor_parallel_matrices_are_gathered(world4):
    """FSDP over TP shards dim 0 twice (a strided shard): m2n has no such placement."""
    for result in results_of(world4, "qwen3 dp_shard=2 x tp=2"):
        for name, placements in result["layout"].items():
            matrix = name.endswith("proj.weight") or "embed" in name
            assert (placements is None) == matrix, name


@pytest.mark.parametrize("case", [*WORLD2, *WORLD4])
def test_each_send_gives_one_tensor_at_a_time_what_listing_them_gave(world2, world4, case):
    """vLLM's engine iterates the source once per server: each time the same tensors, bit for
    bit and in the same order, as listing them all at once; and at every gather, nothing given
    out before is still held (FSDP x TP gathers every matrix: it had them all at once)."""
    world = world2 if case in WORLD2 else world4
    for rank_results in world:
        for dtype in (F32, BF16):
            result = rank_results[(case, str(dtype))]
            assert result["lazy_as_listed"] == [True, True], (case, dtype)
            assert result["kept_at_a_gather"] == [], (case, dtype)
