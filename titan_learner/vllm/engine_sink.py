"""`VLLMEngineSink`: the `WeightSink` interface on a running vLLM engine, through vLLM's RL API.

For a caller who drives the learner and its own engine (the job uses `VLLMGenerator`, which
holds the same transfer): the export is staged and checked against its manifest here, then
sent with the backend's trainer engine; with gloo the engine's workers check it again against
the manifest and their own model before they swap (titan_learner.vllm.gloo_engine).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_learner.vllm.ipc_trainer import require_ipc_handles
from titan_learner.vllm.transfer import EngineWeightTransfer, OfflineClient
from titan_learner.weights.matching import WeightsError
from titan_learner.weights.sinks import StagingSink


class VLLMEngineSink(StagingSink):
    """`engine`: a `vllm.LLM` started with `weight_transfer_config={"backend": backend}` (for
    `nccl`: `"nccl_checked"`, our checked worker engine; `backends.engine_backend`), or any
    client of vLLM's four control calls (`VLLMWeightSyncClient`, e.g. vLLM's
    `HTTPVLLMWeightSyncClient` for a `vllm serve` server) with `workers` given: how many
    inference workers join the transfer (tensor x pipeline x data parallel).

    `backend="ipc"` on a `vllm.LLM`: start it with VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the
    environment (set before `vllm.LLM(...)`, which hands it to its engine process once): its
    `update_weights` msgpack-encodes the CUDA IPC handles, which vLLM pickles only under that
    variable (titan_learner.vllm.ipc_trainer). Without it here the sink refuses at once. The
    handles are sent from the CUDA device current as the sink is built (the engine's GPU)."""

    def __init__(self, engine: Any, *, backend: str = "gloo", workers: int | None = None) -> None:
        super().__init__()
        if hasattr(engine, "llm_engine"):  # an in-process vllm.LLM
            parallel = engine.llm_engine.vllm_config.parallel_config
            workers = parallel.world_size * parallel.data_parallel_size
            engine = OfflineClient(engine)
            if backend == "ipc":
                require_ipc_handles()
        elif workers is None:
            raise TypeError("workers is required with a weight-sync client (its engine's size)")
        if backend == "ipc" and workers != 1:  # else its update fails with the layers unloaded
            raise ValueError(
                "backend 'ipc' hands the engine CUDA IPC handles on this process's GPU, and "
                f"this engine runs {workers} workers (tensor x pipeline x data parallel), each "
                "on a GPU of its own (vLLM's IPC receiver wants a handle on each); allowed: "
                "an engine of one worker on this process's GPU, or backend 'gloo'"
            )
        self.transfer = EngineWeightTransfer(engine, backend, workers)

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        try:
            self.transfer.send(named, version)
        except WeightsError:
            raise
        except Exception as err:
            raise WeightsError(
                f"sending export v{version} to the vLLM engine failed: {err}"
            ) from err

    def close(self) -> None:
        self.transfer.close()
