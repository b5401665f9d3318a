"""The trainer side of the `ipc` backend: vLLM's CUDA-IPC trainer engine, for one rank's engine.

vLLM's IPC trainer engine hands the engine `torch.multiprocessing`'s `reduce_tensor` arguments
for each tensor (its tensor and storage classes, a `torch.dtype`, the CUDA IPC handle) through
`LLM.update_weights`, which msgpack-encodes them to the engine core process. vLLM's encoder and
decoder pickle such objects only under VLLM_ALLOW_INSECURE_SERIALIZATION=1
(vllm/v1/serial_utils.py, `MsgpackEncoder.enc_hook`, `MsgpackDecoder.ext_hook`), and the engine
core reads its environment once, when it starts (vllm.envs caches it there): the variable must
be set before the engine starts, as vLLM's own IPC example for RL does.

`LocalIPCTrainer` is vLLM's trainer engine kept to one trainer rank and its own engine, on that
engine's device.
"""

from __future__ import annotations

import contextlib
import os

import torch
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from titan_learner.vllm.sources import NamedTensorSource

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


class LocalIPCTrainer(IPCTrainerWeightTransferEngine):
    """vLLM's IPC trainer engine for a trainer rank that feeds its own colocated engine.

    vLLM's engine serves trainer ranks that share one engine: whenever torch.distributed is up
    with more than one rank, it all-gathers every rank's handles over the default process group,
    then a barrier and a synchronize of the current device, and a barrier after each send
    (ipc_engine.py `_all_gather_and_merge_handles`, `_post_send_sync`). In the job every
    data-parallel rank sends to its own engine: the other ranks' handles are of no use to it,
    and with max_off_policy_steps > 0 the send runs on the rollout thread, where a collective on
    the default group races the training thread's (a deadlock) and the current CUDA device is
    cuda:0 on every rank. Here the handles are this rank's alone, the step after a send is what
    vLLM runs for a single rank (`ipc_collect`), and the whole send runs on the engine's device,
    the one this engine was built on (`local_ipc_trainer`).

    vLLM's send finishes without a version (the engine's `get_weight_version()` never moves);
    this one finishes with the source's, so the engine reports the version it serves.
    """

    source: NamedTensorSource

    def send_weights(self) -> None:
        """vLLM's send (start, every handle in one update, finish with the version) on the
        engine's device. A failure after start finishes the update, without a version, before
        it is raised: vLLM's start moved the engine's layers to the meta device (layerwise
        reload), only finish puts them back, and until finish the workers refuse the next
        start. Finish keeps, layer by layer, what arrived (vLLM's layerwise finalize): layers
        that received none of the update get their previous weights back, layers that received
        all of it keep the new ones, and one that received part is processed with that part,
        so a failure once the workers had begun loading leaves the two versions mixed until
        the next update replaces them. A failure before the update call (building the handles)
        leaves the previous weights whole."""
        assert self.source is not None
        with torch.cuda.device(self.device_index):
            self.client.start_weight_update()
            try:
                weight_refs = self._send(self.source)  # kept alive past finish (vLLM's note)
            except BaseException:
                finish_quietly(self.client)
                raise
            self.client.finish_weight_update(str(self.source.version))
            self._post_send_sync()
            del weight_refs

    def _all_gather_and_merge_handles(
        self, handles: list[dict[str, tuple]]
    ) -> list[dict[str, tuple]]:
        return handles

    @staticmethod
    def _post_send_sync() -> None:
        torch.cuda.ipc_collect()


def finish_quietly(client: VLLMWeightSyncClient) -> None:
    """Finish a failed update, best effort: its own error is dropped, the send's is raised.
    (Where the workers' own load failed, vLLM has closed the update already, without restoring
    the layers, and refuses this finish: gpu_worker.py `update_weights`; the next update loads
    them.)"""
    with contextlib.suppress(Exception):
        client.finish_weight_update()


def local_ipc_trainer(
    client: VLLMWeightSyncClient, source: NamedTensorSource, device: torch.device | None
) -> LocalIPCTrainer:
    """Our IPC trainer engine, sending from `device` (None: this thread's current CUDA device,
    what vLLM's engine takes), its handshake done; unpacked, vLLM's default."""
    with torch.cuda.device(device):  # vLLM's engine reads the current device as it is built
        return LocalIPCTrainer.trainer_init(
            IPCTrainerInitInfo(rank=0), client=client, source=source
        )
