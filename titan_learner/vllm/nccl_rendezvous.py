"""vLLM's dense NCCL weight transfer, joined from a secret instead of an open store.

vLLM's `NCCLTrainerWeightTransferEngine` meets the servers' workers at a TCPStore it opens on
the trainer's node and names in the init request: while an init is under way, any peer that
reaches that port can take a worker's rank, receive the weights and, as a hop of NCCL's ring,
pass altered bytes on. vLLM's worker side also accepts `nccl_unique_id_b64`, the 128 bytes of
`ncclGetUniqueId` (made for torch-free trainers): the workers then join NCCL's own bootstrap,
which drops a connection that does not carry the id's random magic. Here the trainer mints a
new id per init and sends it only inside the init request, behind the servers' bearer token
(`vllm.auth`): a peer without the token never learns it and cannot join the group.

The broadcast and the workers' receive are vLLM's; the round around them is checked: the
trainer hashes what it sends (`nccl_trainer`) and the workers swap it in only once the
manifest accepts it (`nccl_worker`).
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

from titan_learner.vllm.sources import NamedTensorSource

JOIN_POLL_S = 0.05


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (`ncclGetUniqueId`): the secret a group is joined from, minted
    per init."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return bytes(NCCLLibrary().ncclGetUniqueId().internal)


def encoded(unique_id: bytes) -> str:
    """A unique id as an init request carries it (vLLM's `nccl_unique_id_b64`)."""
    return base64.b64encode(unique_id).decode("ascii")


def worker_init(unique_id: bytes, workers: int) -> dict[str, Any]:
    """The init request's payload for the servers' workers (ranks 1..`workers`, after the
    trainer's 0): the id, and no address or port for anyone to reach. The wire parameters
    (packing, buffers) are vLLM's defaults for a trainer, shipped so both sides agree."""
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from titan_learner.vllm.nccl_worker import CheckedNCCLInitInfo

    defaults = NCCLTrainerInitInfo(rank=0, master_address="", master_port=0, world_size=0)
    info = CheckedNCCLInitInfo(
        rank_offset=1,
        world_size=1 + workers,
        nccl_unique_id_b64=encoded(unique_id),
        packed=defaults.packed,
        packed_buffer_size_bytes=defaults.packed_buffer_size_bytes,
        packed_num_buffers=defaults.packed_num_buffers,
    )
    return worker_init_payload(info)


def secret_nccl_trainer(workers: int, client: Any, source: NamedTensorSource) -> Any:
    """The checked NCCL trainer engine (the sender, rank 0 on this process's CUDA device) in a group
    with `workers` inference workers that join from a unique id minted here.

    Every rank must enter NCCL's init together: the trainer joins on a side thread while the
    init request (which returns once the workers have joined) runs on another. Whichever fails
    first is raised at once: a refused request (a wrong token, a server without the backend),
    or the trainer's own join (the workers that joined then wait in NCCL, which has no
    timeout: restart those servers). The threads left blocked are daemons and do not keep
    the process alive."""
    import torch
    from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

    from titan_learner.vllm.nccl_trainer import CheckedNCCLTrainer

    unique_id = new_unique_id()
    payload = worker_init(unique_id, workers)
    device = torch.accelerator.current_device_index()
    joined: dict[str, Any] = {}

    def join() -> None:
        try:
            joined["group"] = uid_init_process_group(unique_id, 0, 1 + workers, device)
        except BaseException as err:  # handed to the caller's thread below
            joined["error"] = err

    def ask() -> None:
        try:
            client.init_weight_transfer_engine(payload)
            joined["asked"] = True
        except BaseException as err:
            joined["error"] = err

    trainer = threading.Thread(target=join, name="nccl-rendezvous", daemon=True)
    asking = threading.Thread(target=ask, name="nccl-rendezvous-init", daemon=True)
    trainer.start()
    asking.start()
    while "error" not in joined and not ("group" in joined and "asked" in joined):
        time.sleep(JOIN_POLL_S)
    if "error" in joined:
        raise joined["error"]
    engine = CheckedNCCLTrainer(
        client=client,
        source=source,
        packed=payload["packed"],
        packed_buffer_size_bytes=payload["packed_buffer_size_bytes"],
        packed_num_buffers=payload["packed_num_buffers"],
    )
    engine.model_update_group = joined["group"]
    return engine
