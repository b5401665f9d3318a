"""The `nccl` weight channel (issue #39): the workers join from a secret NCCL unique id sent on
the guarded init route, never from an open TCPStore, and swap an update in only once the
manifest the trainer sends on that route accepts what arrived.

On CPU: what the servers' workers receive at init, parsed by our worker engine and refused by
vLLM's plain NCCL engine; the pieces around vLLM's receive and broadcast (host copies, the
trainer's hash). On two GPUs: whole updates through vLLM's NCCL broadcast into our checked
worker engine, accepted and (bytes altered in transit) refused.
"""

from __future__ import annotations

import base64
import os
from types import SimpleNamespace

import pytest
import torch

from tests.support.models import hf_model, state, tiny_config
from tests.support.vllm import needs_vllm, tamper_in_transit
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.matching import WeightsError, copy_into_module

pytestmark = needs_vllm

UNIQUE_ID = os.urandom(128)
F32 = torch.float32


def test_the_workers_get_the_secret_and_no_rendezvous_address():
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from titan_learner.vllm.nccl_rendezvous import worker_init
    from titan_learner.vllm.nccl_worker import CheckedNCCLInitInfo

    payload = worker_init(UNIQUE_ID, workers=3)
    assert "master_address" not in payload and "master_port" not in payload
    assert base64.b64decode(payload["nccl_unique_id_b64"]) == UNIQUE_ID
    parsed = CheckedNCCLInitInfo(**payload)  # what a server's worker builds from it
    assert parsed.nccl_unique_id_bytes == UNIQUE_ID
    assert (parsed.rank_offset, parsed.world_size) == (1, 4)
    trainer = NCCLTrainerInitInfo(rank=0, master_address="", master_port=0, world_size=4)
    wire = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
    assert [getattr(parsed, k) for k in wire] == [getattr(trainer, k) for k in wire]
    assert "nccl_unique_id_b64" not in repr(parsed), "the secret stays out of logs"


def test_a_server_on_vllms_plain_nccl_engine_refuses_the_init_naming_why():
    """Its workers would load each piece unchecked and wait for another round than ours: the
    init request fails (vLLM's own parsing) before any broadcast could hang."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from titan_learner.vllm.nccl_rendezvous import worker_init

    plain = object.__new__(NCCLWeightTransferEngine)  # its parse reads only class attributes
    with pytest.raises(ValueError, match="unexpected keyword argument 'checked_updates'"):
        plain.parse_init_info(worker_init(UNIQUE_ID, workers=1))


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


def test_host_copies_keep_each_piece_as_it_was_when_the_receive_buffer_is_reused():
    """vLLM's packed receive hands `load_weights` views into a buffer it refills."""
    from titan_learner.vllm.nccl_worker import HostCopies

    buffer = torch.arange(10, dtype=F32)
    copies = HostCopies()
    assert copies.load_weights([("a", buffer[:4].view(2, 2)), ("b", buffer[4:])]) == {"a", "b"}
    buffer.fill_(-1.0)
    copies.load_weights([("c", buffer[:3])])
    assert [n for n, _ in copies.named] == ["a", "b", "c"]
    assert torch.equal(copies.named[0][1], torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    assert torch.equal(copies.named[1][1], torch.arange(4, 10, dtype=F32))
    assert torch.equal(copies.named[2][1], torch.full((3,), -1.0))


def test_the_trainer_vouches_for_exactly_what_its_source_handed_the_broadcast():
    from titan_learner.vllm.nccl_trainer import HashedSource
    from titan_learner.vllm.sources import NamedTensorSource
    from titan_learner.weights.export import Checksum, checksum_of

    named = [
        ("w", torch.randn(5, 3)),
        ("v", torch.randn(7, dtype=torch.bfloat16)),
        ("u", torch.randn(4, 6).t()),  # not contiguous: hashed by its values, in order
    ]
    source = NamedTensorSource()
    source.fill(named, version=4)
    digest = Checksum()
    hashed = HashedSource(source, digest)
    assert hashed.metadata() == source.metadata()
    handed = list(hashed)
    assert [n for n, _ in handed] == ["w", "v", "u"]
    assert all(a is b for (_, a), (_, b) in zip(handed, named, strict=True))
    assert digest.hexdigest() == checksum_of(named)
    assert digest.hexdigest() != checksum_of([*named[:2], ("u", named[2][1] + 1e-3)])


def checked_worker(learner, device: torch.device):
    """Our nccl worker engine as vLLM builds it, over a transformers model standing in for
    vLLM's (vLLM's in-place reload is exercised by the gloo backend against real engines)."""
    from titan_learner.vllm.nccl_worker import CheckedNCCLWeightTransferEngine

    class IntoHFModel(CheckedNCCLWeightTransferEngine):
        def _swap(self, staged):
            copy_into_module(self.model, staged, rejected="swap")

    parallel = SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)
    vllm_config = SimpleNamespace(
        parallel_config=parallel, model_config=SimpleNamespace(hf_config=hf_config(learner.spec))
    )
    return IntoHFModel(None, vllm_config, device, hf_model(learner).to(device))


def test_the_checked_worker_refuses_to_swap_without_an_accepted_manifest():
    learner = LocalLearner(tiny_config("qwen3"))
    worker = checked_worker(learner, torch.device("cpu"))
    before = state(worker.model)
    worker.start_weight_update()
    with pytest.raises(WeightsError, match="manifest of v2 but this worker received nothing"):
        worker.update_weights(
            {"version": 2, "names": [], "dtype_names": [], "shapes": [], "checksum": "0"}
        )
    with pytest.raises(WeightsError, match="finish without an accepted manifest"):
        worker.finish_weight_update()
    assert all(torch.equal(t, before[n]) for n, t in worker.model.state_dict().items())


class OnSecondGPU:
    """vLLM's four control calls on one worker engine, each on cuda:1 (a vLLM worker process
    has its device set; here the calls come on the trainer's threads, which stay on cuda:0)."""

    def __init__(self, worker) -> None:
        self.worker, self.versions = worker, []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        with torch.cuda.device(1):
            self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        with torch.cuda.device(1):
            self.worker.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with torch.cuda.device(1):
            self.worker.finish_weight_update()
        self.versions.append(weight_version)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices: NCCL refuses two ranks of one group on one GPU",
)
def test_updates_cross_vllms_nccl_broadcast_and_swap_in_only_when_checked(monkeypatch):
    from titan_learner.vllm.transfer import EngineWeightTransfer

    torch.cuda.set_device(0)
    learner = LocalLearner(tiny_config("qwen3"))
    client = OnSecondGPU(checked_worker(learner, torch.device("cuda:1")))
    transfer = EngineWeightTransfer(client, "nccl", workers=1)
    try:
        named = [(n, t.to("cuda:0")) for n, t in learner.get_weights(dtype=F32).items()]
        transfer.send(named, version=3)
        assert client.versions == ["3"] and client.worker._staged is None
        served = client.worker.model.state_dict()
        for name, tensor in named:
            assert torch.equal(served[name].cpu(), tensor.cpu()), name
        before = state(client.worker.model)
        tamper_in_transit(monkeypatch, transfer.engine)
        with pytest.raises(WeightsError, match="refused export v4, it serves its previous"):
            transfer.send(named, version=4)
        assert all(torch.equal(t, before[n]) for n, t in client.worker.model.state_dict().items())
        assert client.versions == ["3"]
    finally:
        transfer.close()
        client.worker.shutdown()
