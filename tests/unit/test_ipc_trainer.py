"""The `ipc` weight transfer's trainer side (titan_learner.vllm.ipc_trainer), on CPU.

The IPC handles of an update cross vLLM's own msgpack channel to the engine core only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1, as our generator sets it: checked with vLLM's real
encoder and decoder, on a message of the shape `LLM.update_weights` sends. A real CUDA handle
needs a GPU (scripts/gpu_smoke.sh); here the handle's arguments are built the way torch's
`reduce_tensor` builds them for a CUDA tensor, with the same types.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

from tests.support.vllm import needs_vllm

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
    from types import SimpleNamespace

    from titan_learner.vllm.engine_sink import VLLMEngineSink

    parallel = SimpleNamespace(world_size=1, data_parallel_size=1)
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))
    )
    with pytest.raises(ValueError, match="only with VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        VLLMEngineSink(llm, backend="ipc")
