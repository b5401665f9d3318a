"""The `nccl` weight channel joins from a secret NCCL unique id sent on the guarded init route,
never from an open TCPStore (issue #39): what the servers' workers receive, parsed by vLLM's
own worker-side init info, and (on two GPUs) a whole update through vLLM's NCCL engine."""

from __future__ import annotations

import base64
import os

import pytest
import torch

pytest.importorskip("vllm", reason="the nccl weight channel is vLLM's engine")

UNIQUE_ID = os.urandom(128)


def test_the_workers_get_the_secret_and_no_rendezvous_address():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from titan_learner.vllm.nccl_rendezvous import worker_init

    payload = worker_init(UNIQUE_ID, workers=3)
    assert "master_address" not in payload and "master_port" not in payload
    assert base64.b64decode(payload["nccl_unique_id_b64"]) == UNIQUE_ID
    parsed = NCCLWeightTransferInitInfo(**payload)  # what a server's worker builds from it
    assert parsed.nccl_unique_id_bytes == UNIQUE_ID
    assert (parsed.rank_offset, parsed.world_size) == (1, 4)
    trainer = NCCLTrainerInitInfo(rank=0, master_address="", master_port=0, world_size=4)
    wire = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
    assert [getattr(parsed, k) for k in wire] == [getattr(trainer, k) for k in wire]
    assert "nccl_unique_id_b64" not in repr(parsed), "the secret stays out of logs"


def test_every_server_gets_the_same_secret_and_its_own_ranks():
    from titan_learner.vllm.nccl_rendezvous import worker_init
    from titan_learner.vllm.server_group import ServerGroup

    class Server:
        def __init__(self, workers: int) -> None:
            self.count, self.init = workers, None

        def workers(self) -> int:
            return self.count

        def init_weight_transfer_engine(self, init_info: dict) -> None:
            self.init = init_info

    servers = [Server(2), Server(1), Server(4)]
    group = ServerGroup(servers)
    group.init_weight_transfer_engine(worker_init(UNIQUE_ID, group.total_workers))
    assert [s.init["rank_offset"] for s in servers] == [1, 3, 4]
    assert {s.init["nccl_unique_id_b64"] for s in servers} == {base64.b64encode(UNIQUE_ID).decode()}
    assert {s.init["world_size"] for s in servers} == {8}


class SecondGPUWorker:
    """vLLM's worker side of the dense NCCL backend (its init info, its unique-id join, its
    packed receive) on this process's second GPU, answering the trainer engine's four calls."""

    def init_weight_transfer_engine(self, payload: dict) -> None:
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            uid_init_process_group,
        )

        self.info = NCCLWeightTransferInitInfo(**payload)
        self.group = uid_init_process_group(
            self.info.nccl_unique_id_bytes, self.info.rank_offset, self.info.world_size, 1
        )

    def start_weight_update(self) -> None:
        self.received: dict[str, torch.Tensor] = {}

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        info = (update_info[k] for k in ("names", "dtype_names", "shapes"))
        expected = zip(*info, strict=True)
        packed_nccl_broadcast_consumer(
            iterator=((n, (s, getattr(torch, d))) for n, d, s in expected),
            group=self.group,
            src=0,
            post_unpack_func=lambda pairs: self.received.update(
                {n: t.to("cpu", copy=True) for n, t in pairs}
            ),
            buffer_size_bytes=self.info.packed_buffer_size_bytes,
            num_buffers=self.info.packed_num_buffers,
            device=torch.device("cuda:1"),
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version = weight_version


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL refuses two ranks of one group on one GPU",
)
def test_an_update_crosses_vllms_nccl_engine_joined_from_the_secret():
    from titan_learner.vllm.transfer import EngineWeightTransfer

    torch.cuda.set_device(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(300, 64, device="cuda:0")),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, device="cuda:0")),
        ("model.norm.weight", torch.randn(64, device="cuda:0", dtype=torch.bfloat16)),
    ]
    worker = SecondGPUWorker()
    transfer = EngineWeightTransfer(worker, "nccl", workers=1)
    try:
        assert worker.info.master_address is None and worker.info.master_port is None
        transfer.send(named, version=3)
        assert list(worker.received) == [name for name, _ in named]
        for name, tensor in named:
            assert torch.equal(worker.received[name], tensor.cpu()), name
    finally:
        transfer.close()
        worker.group.destroy()
