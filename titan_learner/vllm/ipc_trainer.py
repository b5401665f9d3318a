"""The trainer side of the `ipc` backend: vLLM's CUDA-IPC trainer engine, for one rank's engine.

vLLM's IPC trainer engine hands the engine `torch.multiprocessing`'s `reduce_tensor` arguments
for each tensor (its tensor and storage classes, a `torch.dtype`, the CUDA IPC handle) through
`LLM.update_weights`, which msgpack-encodes them to the engine core process. vLLM's encoder and
decoder pickle such objects only under VLLM_ALLOW_INSECURE_SERIALIZATION=1
(vllm/v1/serial_utils.py, `MsgpackEncoder.enc_hook`, `MsgpackDecoder.ext_hook`), and the engine
core reads its environment once, when it starts (vllm.envs caches it there): the variable must
be set before the engine starts, as vLLM's own IPC example for RL does.
"""

from __future__ import annotations

import os

INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def allow_ipc_handles() -> None:
    """Let this process and the engines it starts after this call carry IPC handles.

    What it allows: pickled objects on the sockets between this process and its engine core
    (for one local engine, local IPC sockets: vllm/v1/engine/utils.py
    `get_engine_zmq_bind_addresses`). A value the environment already has is kept, and refused
    here if it does not allow them (`require_ipc_handles`)."""
    os.environ.setdefault(INSECURE_SERIALIZATION, "1")
    require_ipc_handles()


def require_ipc_handles() -> None:
    """ValueError unless vLLM, as it reads its environment in this process, lets the IPC
    handles through (before a send, not as a TypeError midway through an update)."""
    from vllm import envs

    if not envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
        raise ValueError(
            f"weight_transfer 'ipc' sends CUDA IPC handles that vLLM pickles only with "
            f"{INSECURE_SERIALIZATION}=1, and vLLM reads it as off here (the environment has "
            f"{os.environ.get(INSECURE_SERIALIZATION)!r}); allowed: "
            f"{INSECURE_SERIALIZATION}=1 in the environment before the engine starts, or "
            "weight_transfer gloo"
        )
