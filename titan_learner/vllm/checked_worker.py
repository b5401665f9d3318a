"""Verify before swap: what our worker engines (gloo, nccl) do with an update once received.

Received tensors are held in host memory until the manifest (the second `update_weights`, see
`update_wire`) has been checked against them (names, order, dtypes, shapes, xxh3 of the bytes,
version) and against the served model's own parameters (names and shapes from its transformers
config). Only `finish_weight_update` after an accepted manifest swaps them in, with vLLM's
in-place `reload_weights` (checkpoint format: vLLM maps HF names onto its fused,
tensor-parallel layers and redoes any weight packing). A refused update raises from
`update_weights`, which ends the worker's update session: the served weights are untouched.
Holding the export costs one model copy of host memory per worker during an update.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_learner.dtypes import dtype_name
from titan_learner.model.hf_config import hf_parameter_shapes
from titan_learner.vllm.refusals import REFUSED
from titan_learner.vllm.update_wire import ManifestedUpdateInfo
from titan_learner.weights.export import WeightsManifest
from titan_learner.weights.matching import WeightsError, match_named_tensors
from titan_learner.weights.sinks import verify

Named = list[tuple[str, torch.Tensor]]


class CheckedUpdates:
    """The update half of a vLLM `WeightTransferEngine`, placed before it in a worker engine's
    bases; the engine supplies `_receive` (the data channel) and vLLM's base the rest."""

    update_info_cls = ManifestedUpdateInfo
    supports_draft_weight_update = False
    model: Any
    model_config: Any
    vllm_config: Any
    device: torch.device

    def _start_checking(self) -> None:
        """Called from the engine's __init__, after vLLM's base has set the served model."""
        self._staged: Named | None = None
        self._staged_version: int | None = None
        self._verified = False
        self._served = hf_parameter_shapes(self.model_config.hf_config)

    def _receive(self, update_info: ManifestedUpdateInfo) -> Named:
        """The announced tensors, off the data channel, in host memory."""
        raise NotImplementedError

    def start_weight_update(self) -> None:
        self._drop()

    def receive_weights(self, update_info: ManifestedUpdateInfo) -> None:
        if update_info.abandoned:  # raising ends vLLM's session (update_session)
            self._drop()
            raise WeightsError(f"{REFUSED}the trainer abandoned this update")
        if update_info.checksum is None:
            staged = self._receive(update_info)
            self._staged, self._staged_version, self._verified = staged, update_info.version, False
            return
        try:
            self._check(update_info)
        except WeightsError as err:
            self._drop()
            raise WeightsError(f"{REFUSED}{err}") from None
        except BaseException:
            self._drop()
            raise

    def _check(self, manifest: ManifestedUpdateInfo) -> None:
        """Raise WeightsError unless the staged export is the manifest's and fits the model."""
        if self._staged is None or self._staged_version != manifest.version:
            raise WeightsError(
                f"manifest of v{manifest.version} but this worker received "
                f"{'nothing' if self._staged is None else f'v{self._staged_version}'}"
            )
        verify(self._staged, _manifest(manifest))
        dtypes = [dtype_name(t.dtype) for _, t in self._staged]
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

    def _swap(self, staged: Named) -> None:
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


def _manifest(info: ManifestedUpdateInfo) -> WeightsManifest:
    return WeightsManifest(
        version=info.version,
        names=tuple(info.names),
        shapes=tuple(tuple(int(d) for d in shape) for shape in info.shapes),
        dtypes=tuple(info.dtype_names),
        checksum=str(info.checksum),
    )
