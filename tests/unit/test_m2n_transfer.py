"""The `nccl_m2n` channel's pieces that run without NCCL (the reshard itself needs NVIDIA's
nccl-extensions and GPUs, which no machine here has): the init info each server gets, parsed by
vLLM's own worker side, and the version the servers are finished with."""

from __future__ import annotations

import base64
import os

import pytest
import torch

from tests.support.models import tiny_config
from tests.support.vllm import needs_vllm
from titan_learner.learner.local import LocalLearner

pytestmark = needs_vllm

UNIQUE_ID = base64.b64encode(os.urandom(128)).decode("ascii")


@pytest.mark.parametrize(
    ("workers", "tensor_parallel", "mesh"),
    [(1, 1, (1, 1)), (4, 2, (2, 2)), (2, 2, (1, 2)), (3, 2, (3, 1))],
    ids=["one worker", "two replicas of tp=2", "tp=2", "tp that does not divide: flat"],
)
def test_each_server_is_one_mesh_of_replicas_by_tensor_parallel_workers(
    workers, tensor_parallel, mesh
):
    from titan_learner.vllm.m2n_trainer import m2n_init_info

    info = m2n_init_info(1, 2, workers, tensor_parallel, UNIQUE_ID)
    assert (info.rank, info.num_trainer_ranks, info.world_size) == (1, 2, 2 + workers)
    assert info.destination_mesh_dims == mesh
    assert base64.b64decode(info.nccl_unique_id_b64) == base64.b64decode(UNIQUE_ID)
    assert UNIQUE_ID not in repr(info), "the secret stays out of logs"


def test_vllm_refuses_a_trainer_rank_outside_the_trainer():
    from titan_learner.vllm.m2n_trainer import m2n_init_info

    with pytest.raises(ValueError, match=r"trainer `rank` \(2\) must be below"):
        m2n_init_info(2, 2, 1, 1, UNIQUE_ID)


def test_the_servers_init_request_parses_on_vllms_worker_side():
    """The payload vLLM's m2n trainer engine sends for our source, as its workers parse it: the
    learner's Hugging Face names in export order, the serving dtype, the whole shapes."""
    from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerWeightTransferEngine

    from titan_learner.vllm.m2n_source import ShardSource, local_shards
    from titan_learner.vllm.m2n_trainer import m2n_init_info

    learner = LocalLearner(tiny_config("llama3"))
    exported = learner.get_weights(dtype=torch.bfloat16)
    source = ShardSource(local_shards(learner.model, learner.spec, torch.bfloat16, 1))
    trainer = object.__new__(M2NTrainerWeightTransferEngine)  # init would join NCCL
    trainer._src_mesh, trainer._metas = source.mesh(), source.metadata()
    payload = trainer._worker_init_info(m2n_init_info(0, 1, 2, 2, UNIQUE_ID))
    parsed = M2NWeightTransferInitInfo(**payload)
    assert parsed.names == list(exported.keys())
    assert parsed.shapes == [list(t.shape) for t in exported.values()]
    assert set(parsed.dtype_names) == {"bfloat16"}
    assert parsed.src_placements == [None] * len(parsed.names)  # one process holds it all
    assert (parsed.rank_offset, parsed.world_size, parsed.dst_mesh_dims) == (1, 3, [1, 2])
    assert parsed.src_mesh_dims == [1, 1]


def test_the_servers_are_finished_with_the_version_sent():
    from titan_learner.vllm.m2n_trainer import VersionedFinish

    class Server:
        def __init__(self) -> None:
            self.calls: list = []

        def __getattr__(self, route: str):
            return lambda *args: self.calls.append((route, *args))

    server = Server()
    client = VersionedFinish(server)
    client.version = 7
    client.start_weight_update()
    client.update_weights({"names": ["a"]})
    client.finish_weight_update()  # vLLM's m2n engine names no version
    assert server.calls == [
        ("start_weight_update",),
        ("update_weights", {"names": ["a"]}),
        ("finish_weight_update", "7"),
    ]


def test_a_tensor_split_over_more_ranks_than_m2n_lets_feed_one_destination_goes_whole():
    """vLLM's workers refuse a replicated destination fed by more than MAX_SOURCE_SHARDS source
    shards at their init, while every trainer rank waits in NCCL's init for them (FSDP over 17
    ranks). LocalShards' decision, on the numbers (a world of 17 ranks is out of reach here):
    up to the limit a tensor goes as shards, over it whole, and vLLM's check passes both."""
    from vllm.distributed.weight_transfer.m2n_common import (
        MAX_SOURCE_SHARDS,
        M2NMesh,
        check_plan_limits,
        resolve_layout,
    )

    from titan_learner.weights.local_shards import REPLICATE, _m2n_splits

    most, rows = MAX_SOURCE_SHARDS, MAX_SOURCE_SHARDS * (MAX_SOURCE_SHARDS + 1)  # even for both
    destination = resolve_layout(M2NMesh((2, 1), most + 1), None)  # replicated on 2 workers

    def vllm_checks(shards: int, placements) -> None:
        source = resolve_layout(M2NMesh((shards, 1), 0), placements)
        check_plan_limits(source, destination, "model.embed_tokens.weight")

    assert _m2n_splits(rows, rows, most, MAX_SOURCE_SHARDS)
    vllm_checks(most, (0, REPLICATE))
    assert not _m2n_splits(rows, rows, most + 1, MAX_SOURCE_SHARDS)
    vllm_checks(most + 1, None)  # whole
    with pytest.raises(ValueError, match=f"would feed {most + 1} source shards"):
        vllm_checks(most + 1, (0, REPLICATE))  # what the shards would have met
    assert not _m2n_splits(rows + 1, rows + 1, 2, MAX_SOURCE_SHARDS)  # uneven: whole


def test_nccl_m2n_sends_only_the_generators_own_shards():
    """Each server's send iterates the shards the generator was built with afresh: other
    tensors handed to `load_weights` are refused, not ignored."""
    from titan_learner.vllm.m2n_source import local_shards
    from titan_learner.vllm.server_generator import ServerGenerator

    learner = LocalLearner(tiny_config("llama3"))
    generator = object.__new__(ServerGenerator)  # building one needs GPU servers
    generator.local_shards = local_shards(learner.model, learner.spec, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="pass the generator's `local_shards`"):
        generator.load_weights(list(generator.local_shards), version=1)


LAYER_1 = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
LAYER_1 += ["mlp.gate_proj", "mlp.down_proj", "mlp.up_proj", "input_layernorm"]
REFUSED = {
    "vocab_size": "wrong shapes: model.embed_tokens.weight: got (32, 64), the model has (48, 64); "
    "lm_head.weight: got (32, 64), the model has (48, 64)",
    "num_hidden_layers": "unknown names (not parameters of the model): "
    + ", ".join(f"model.layers.1.{name}.weight" for name in LAYER_1)
    + " (and 1 more)",
}


@pytest.mark.parametrize(("key", "value"), [("vocab_size", 48), ("num_hidden_layers", 1)])
def test_shards_that_do_not_fit_the_served_model_are_refused_before_any_server_is_asked(key, value):
    """vLLM's m2n checks no name or shape against the served model (what it cannot place fails
    in the model's load_weights mid-update, the trainer ranks waiting in the reshards): the
    generator refuses them as every backend refuses an update, before it asks any server (none
    listens at the url: a request would have failed first)."""
    from tests.support.servers import free_port
    from titan_learner.model.hf_config import hf_config, hf_parameter_shapes
    from titan_learner.vllm.m2n_source import local_shards
    from titan_learner.vllm.server_generator import ServerGenerator, check_shards
    from titan_learner.weights.matching import WeightsError

    learner = LocalLearner(tiny_config("llama3"))
    shards = local_shards(learner.model, learner.spec, torch.bfloat16, 1)
    check_shards(shards, *hf_parameter_shapes(hf_config(learner.spec)))  # the model they fit
    served = hf_config(learner.spec)
    setattr(served, key, value)
    with pytest.raises(WeightsError) as refused:
        ServerGenerator(
            [f"http://127.0.0.1:{free_port()}"],
            served,
            eos_id=1,
            pad_id=0,
            dtype=torch.bfloat16,
            sequence_len=64,
            sender=True,
            weight_transfer="nccl_m2n",
            token="test-token-not-a-secret",
            shards=shards,
        )
    assert str(refused.value) == (
        f"load_weights rejected the weights, nothing was sent: {REFUSED[key]}"
    )
