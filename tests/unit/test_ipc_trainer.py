"""The `ipc` weight transfer's trainer side (titan_learner.vllm.ipc_trainer), on CPU.

The IPC handles of an update cross vLLM's own msgpack channel to the engine core only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1, as our generator sets it: checked with vLLM's real
encoder and decoder, on a message of the shape `LLM.update_weights` sends. A real CUDA handle
needs a GPU (scripts/gpu_smoke.sh); here the handle's arguments are built the way torch's
`reduce_tensor` builds them for a CUDA tensor, with the same types.

Our trainer engine's send, on CPU tensors with torch's CUDA device calls stood in for
(`FakeCuda`): one rank of a real two-rank gloo world sends alone, so any collective on the
default group would fail it, and every call runs on the device the engine was built for; a
send that fails after start still finishes the update.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from tests.support.vllm import needs_vllm
from tests.support.worlds import run_world

pytestmark = needs_vllm

GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def cuda_handle_args(tensor: torch.Tensor) -> tuple:
    """`reduce_tensor`'s rebuild arguments for a CUDA tensor (torch/multiprocessing/
    reductions.py), of the same types, from a CPU tensor: the handles are random bytes."""
    storage = tensor._typed_storage()
    return (
        type(tensor),
        tensor.size(),
        tensor.stride(),
        tensor.storage_offset(),
        type(storage),
        tensor.dtype,
        0,  # device index
        os.urandom(64),  # cudaIpcMemHandle
        tensor.untyped_storage().nbytes(),
        0,  # storage offset in the allocation
        tensor.requires_grad,
        os.urandom(16),  # ref counter handle
        0,
        os.urandom(64),  # event handle
        True,
    )


def update_message(tensors: dict[str, torch.Tensor]) -> tuple:
    """What `LLM.update_weights` hands the engine core client for vLLM's IPC trainer engine's
    update (ipc_engine.py `_do_send`): `call_utility`'s tuple (core_client.py) around
    `collective_rpc("update_weights", kwargs={"update_info": ...})`."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    info = IPCWeightTransferUpdateInfo(
        names=list(tensors),
        dtype_names=[str(t.dtype).split(".")[-1] for t in tensors.values()],
        shapes=[list(t.shape) for t in tensors.values()],
        ipc_handles=[{GPU_UUID: cuda_handle_args(t)} for t in tensors.values()],
    )
    rpc_args = ("update_weights", None, (), {"update_info": asdict(info)})
    return (0, 1234, "collective_rpc", rpc_args)


@pytest.fixture
def vllm_env(monkeypatch):
    """VLLM_ALLOW_INSECURE_SERIALIZATION unset, read by vLLM afresh on every access (as it is
    in a trainer process until an engine core runs in it); restored afterwards."""
    from vllm import envs

    from titan_learner.vllm.ipc_trainer import INSECURE_SERIALIZATION

    envs.disable_envs_cache()  # vLLM's own switch for isolating unit tests
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    return monkeypatch


def test_ipc_handles_cross_vllms_msgpack_channel_only_once_our_generator_allowed_them(vllm_env):
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from titan_learner.vllm.ipc_trainer import INSECURE_SERIALIZATION, allow_ipc_handles

    tensors = {
        "model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(4),
    }
    message = update_message(tensors)
    with pytest.raises(TypeError, match="is not serializable"):
        MsgpackEncoder().encode(message)  # what the trainer's LLM.update_weights raised

    allow_ipc_handles()  # what VLLMGenerator does before it starts an ipc engine
    assert os.environ[INSECURE_SERIALIZATION] == "1"
    frames = MsgpackEncoder().encode(message)
    client, call_id, method, (rpc, _, _, kwargs) = MsgpackDecoder().decode(frames)
    assert (client, call_id, method, rpc) == (0, 1234, "collective_rpc", "update_weights")
    engine = object.__new__(IPCWeightTransferEngine)  # its parse reads only class attributes
    info = engine.parse_update_info(kwargs["update_info"])
    assert info.names == list(tensors)
    assert info.dtype_names == ["bfloat16", "float32"]
    sent = message[3][3]["update_info"]["ipc_handles"]
    for received, expected in zip(info.ipc_handles, sent, strict=True):
        args, sent_args = received[GPU_UUID], expected[GPU_UUID]
        assert len(args) == len(sent_args) == 15
        assert args[0] is torch.Tensor and args[4] is sent_args[4]
        assert args[5] is sent_args[5]  # the torch.dtype, the same object
        assert list(args[1]) == list(sent_args[1]) and args[7] == sent_args[7]

    vllm_env.setenv(INSECURE_SERIALIZATION, "0")  # an engine core started without it
    with pytest.raises(NotImplementedError, match="Extension type code"):
        MsgpackDecoder().decode(frames)


def test_an_environment_that_refuses_the_handles_is_kept_and_one_line(vllm_env):
    from titan_learner.vllm.ipc_trainer import INSECURE_SERIALIZATION, allow_ipc_handles

    vllm_env.setenv(INSECURE_SERIALIZATION, "0")
    with pytest.raises(ValueError) as caught:
        allow_ipc_handles()
    assert os.environ[INSECURE_SERIALIZATION] == "0"
    assert str(caught.value) == (
        "weight_transfer 'ipc' sends CUDA IPC handles that vLLM pickles only with "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1, and vLLM reads it as off here (the environment "
        "has '0'); allowed: VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment before the "
        "engine starts, or weight_transfer gloo"
    )


def test_an_engine_sink_on_an_llm_without_the_variable_refuses_before_any_update(vllm_env):
    from titan_learner.vllm.engine_sink import VLLMEngineSink

    parallel = SimpleNamespace(world_size=1, data_parallel_size=1)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    )
    with pytest.raises(ValueError, match="only with VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        VLLMEngineSink(llm, backend="ipc")


def test_an_engine_sink_over_several_workers_refuses_ipc_before_any_update(vllm_env):
    """vLLM's IPC receiver fails on a worker whose GPU has no handle, once start_weight_update
    has already unloaded its layers: refused at the sink's construction instead."""
    from titan_learner.vllm.engine_sink import VLLMEngineSink
    from titan_learner.vllm.ipc_trainer import INSECURE_SERIALIZATION

    vllm_env.setenv(INSECURE_SERIALIZATION, "1")
    parallel = SimpleNamespace(world_size=2, data_parallel_size=1)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    )
    for engine, workers in ((llm, None), (object(), 2)):  # a vllm.LLM; a weight-sync client
        with pytest.raises(ValueError) as info:
            VLLMEngineSink(engine, backend="ipc", workers=workers)
        assert str(info.value) == (
            "backend 'ipc' hands the engine CUDA IPC handles on this process's GPU, and this "
            "engine runs 2 workers (tensor x pipeline x data parallel), each on a GPU of its "
            "own (vLLM's IPC receiver wants a handle on each); allowed: an engine of one "
            "worker on this process's GPU, or backend 'gloo'"
        )


GROUP_TIMEOUT_S = 10
"""How long a collective on the test's default group may wait: a send that entered one fails
within this instead of hanging."""


class FakeCuda:
    """torch's CUDA device calls that vLLM's IPC trainer engine and ours make, on a machine
    without CUDA: the current device (an index, 0 at first), the GPU UUIDs ("GPU-<index>").
    `patch`: how torch's attributes are replaced (monkeypatch.setattr in the test process)."""

    def __init__(self, patch=setattr) -> None:
        self.current = 0
        self.collected_on: list[int] = []
        fake = self

        class Device:
            def __init__(self, device) -> None:
                index = device.index if isinstance(device, torch.device) else device
                self.index = fake.current if index is None else index

            def __enter__(self) -> None:
                self.previous, fake.current = fake.current, self.index

            def __exit__(self, *_) -> None:
                fake.current = self.previous

        patch(torch.cuda, "device", Device)
        patch(torch.accelerator, "current_device_index", lambda: fake.current)
        patch(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
        patch(torch.cuda, "ipc_collect", lambda: fake.collected_on.append(fake.current))


class RecordingClient:
    """vLLM's four control calls, recorded with the current (fake) CUDA device of each."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.calls: list[tuple] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(("init", self.cuda.current, init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", self.cuda.current))

    def update_weights(self, update_info: dict) -> None:
        uuids = [sorted(handle) for handle in update_info["ipc_handles"]]
        self.calls.append(("update", self.cuda.current, update_info["names"], uuids))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", self.cuda.current, weight_version))


class FailingClient(RecordingClient):
    """The engine refuses the update, then the finish of it (as vLLM's workers do once their
    own update failed)."""

    def update_weights(self, update_info: dict) -> None:
        super().update_weights(update_info)
        raise RuntimeError("the engine refused the update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        raise RuntimeError("finish_weight_update called without a matching start_weight_update")


class FailingSource(list):
    """An export whose second tensor fails to come (a gather that raised)."""

    def __iter__(self):
        yield self[0]
        raise ValueError("the export failed midway")


def lone_sender(rank: int) -> dict | None:
    """Rank 1 of a two-rank world sends to its own engine from cuda:1 while rank 0 does
    nothing: what it recorded."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    if rank == 0:
        return None
    from titan_learner.vllm.transfer import EngineWeightTransfer

    cuda = FakeCuda()
    client = RecordingClient(cuda)
    transfer = EngineWeightTransfer(client, "ipc", workers=1, device=torch.device("cuda", 1))
    built = list(client.calls)
    named = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(8, 4))]
    transfer.send(named, 3)
    return {
        "built": built,
        "sent": client.calls[len(built) :],
        "collected_on": cuda.collected_on,
        "current_after": cuda.current,
    }


def test_a_rank_sends_to_its_own_engine_alone_on_its_engines_device():
    _, lone = run_world(2, lone_sender, timeout=120)
    assert lone["built"] == [("init", 1, {"packed": False})]
    assert lone["sent"] == [
        ("start", 1),
        ("update", 1, ["model.norm.weight", "lm_head.weight"], [["GPU-1"], ["GPU-1"]]),
        ("finish", 1, "3"),  # the engine reports the version it serves
    ]
    assert lone["collected_on"] == [1]
    assert lone["current_after"] == 0


@pytest.mark.parametrize("failing", ["update", "source"])
def test_a_send_that_fails_after_start_finishes_the_update_and_raises_its_own_error(
    monkeypatch, failing
):
    """Else the engine's layers stay on the meta device and its workers refuse the next start."""
    from titan_learner.vllm.ipc_trainer import local_ipc_trainer
    from titan_learner.vllm.sources import NamedTensorSource

    cuda = FakeCuda(monkeypatch.setattr)
    client = FailingClient(cuda) if failing == "update" else RecordingClient(cuda)
    source = NamedTensorSource()
    engine = local_ipc_trainer(client, source, torch.device("cuda", 1))
    named = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(8, 4))]
    source.fill(FailingSource(named) if failing == "source" else named, 3)
    message = "the engine refused the update" if failing == "update" else "failed midway"
    with pytest.raises((RuntimeError, ValueError), match=message):
        engine.send_weights()
    calls = {"update": ["start", "update", "finish"], "source": ["start", "finish"]}[failing]
    assert [call[:2] for call in client.calls[1:]] == [(call, 1) for call in calls]
    assert client.calls[-1] == ("finish", 1, None)  # the engine keeps its version
    assert cuda.current == 0
