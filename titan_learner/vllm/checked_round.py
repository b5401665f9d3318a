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
from typing import Any

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from titan_learner.dtypes import dtype_name
from titan_learner.vllm.stuck_send import SendGuard
from titan_learner.vllm.update_wire import ManifestedUpdateInfo
from titan_learner.weights.matching import WeightsError

Broadcast = Callable[[WeightSource, list[ParamMeta]], str]
"""Sends the source's tensors on the data channel; the xxh3 checksum of what it sent. Raises
ValueError where the source disagrees with its metadata (vLLM's `_checked_iter`)."""


def send_checked(
    client: Any, source: WeightSource, broadcast: Broadcast, is_sender: bool, *, channel: str
) -> None:
    """One update of the source's export. Other trainer ranks only iterate the source, which
    keeps them in any collective it runs (an FSDP gather). `client`: vLLM's control calls
    with `abandon_weight_update` (`UpdateSession`, `ServerGroup`), which ends any session a
    failed round leaves open, so the next update (or a restarted job) is not refused.
    `channel` names the broadcast ("gloo broadcast"): where the engines' side fails while it
    still runs, `SendGuard` stops the job with their error rather than wait on it for good."""
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
    try:
        client.start_weight_update()
    except BaseException:
        client.abandon_weight_update()  # the engines that did start (one server of several)
        raise
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        with SendGuard(f"the trainer's {channel}") as guard:
            receiving = executor.submit(client.update_weights, asdict(announce))
            receiving.add_done_callback(guard.control_done)
            if receiving.done():  # refused before the workers entered the broadcast
                receiving.result()
            try:
                checksum = broadcast(source, meta)
            except ValueError as err:  # the source disagreed with its metadata (vLLM's check)
                raise WeightsError(str(err)) from None
        receiving.result()
    finally:
        # A failed broadcast leaves the workers waiting: their update raises when the data
        # channel gives up, which ends their session.
        executor.shutdown(wait=False)
    manifest = replace(announce, checksum=checksum)
    try:
        try:
            client.update_weights(asdict(manifest))
        except Exception as err:
            raise WeightsError(
                f"the vLLM engine refused export v{version}, it serves its previous weights: {err}"
            ) from err
        client.finish_weight_update(str(version))
    except BaseException:
        client.abandon_weight_update()  # engines that accepted what another refused
        raise
