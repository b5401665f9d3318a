"""The trainer side of one checked update (gloo, nccl): announce, broadcast, manifest, finish.

vLLM's trainer engines run start -> update (while the tensors are broadcast) -> finish. Ours
add a second `update_weights` with the manifest of what was broadcast (`update_wire`), which
the workers check before they swap anything in (`checked_worker`), and hand the version to
`finish_weight_update` so the engine reports the version it serves.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    VLLMWeightSyncClient,
    WeightSource,
)

from titan_learner.dtypes import dtype_name
from titan_learner.vllm.update_wire import ManifestedUpdateInfo
from titan_learner.weights.matching import WeightsError

Broadcast = Callable[[WeightSource, list[ParamMeta]], str]
"""Sends the source's tensors on the data channel; the xxh3 checksum of what it sent. Raises
ValueError where the source disagrees with its metadata (vLLM's `_checked_iter`)."""


def send_checked(
    client: VLLMWeightSyncClient, source: WeightSource, broadcast: Broadcast, is_sender: bool
) -> None:
    """One update of the source's export. Other trainer ranks only iterate the source, which
    keeps them in any collective it runs (an FSDP gather)."""
    meta = source.metadata()
    if not is_sender:
        for _ in source:
            pass
        return
    version = int(getattr(source, "version", 0))
    announce = ManifestedUpdateInfo(
        version=version,
        names=[m.name for m in meta],
        dtype_names=[dtype_name(m.dtype) for m in meta],
        shapes=[list(m.shape) for m in meta],
    )
    client.start_weight_update()
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        receiving = executor.submit(client.update_weights, asdict(announce))
        if receiving.done():  # refused before the workers entered the broadcast
            receiving.result()
        try:
            checksum = broadcast(source, meta)
        except ValueError as err:  # the source disagreed with its metadata (vLLM's check)
            raise WeightsError(str(err)) from None
        receiving.result()
    finally:
        executor.shutdown(wait=False)  # a failed broadcast leaves the workers waiting
    manifest = replace(announce, checksum=checksum)
    try:
        client.update_weights(asdict(manifest))
    except Exception as err:
        raise WeightsError(
            f"the vLLM engine refused export v{version}, it serves its previous weights: {err}"
        ) from err
    client.finish_weight_update(str(version))
