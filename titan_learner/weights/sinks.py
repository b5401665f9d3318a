"""Where exported weights go: an in-process HF model, a safetensors directory, a generator.

A sink sees one export as begin -> write(bucket)... -> commit(manifest), or abort. Nothing a
receiver serves changes before commit, and commit first checks the manifest (every name, shape,
dtype and the checksum of the bytes received), so a transfer that fails midway leaves the
receiver's previous weights in place. `push_weights` drives any sink from a learner.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from titan_learner.weights.export import TIED_HF_PAIR, Bucket, WeightsManifest, checksum_of
from titan_learner.weights.matching import WeightsError, copy_into_module, match_named_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from titan_learner.learner.contract import Learner


class WeightSink(Protocol):
    def begin(self, version: int) -> None: ...

    def write(self, bucket: Bucket) -> None: ...

    def commit(self, manifest: WeightsManifest) -> None: ...

    def abort(self) -> None: ...


class StagingSink:
    """Collects a whole export, verifies it against the manifest, then hands it on at once."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        self._pending_version: int | None = None
        self.version: int | None = None

    def begin(self, version: int) -> None:
        self._staged = []
        self._pending_version = int(version)

    def write(self, bucket: Bucket) -> None:
        if self._staged is None:
            raise WeightsError("write() before begin()")
        self._staged.extend(bucket)

    def abort(self) -> None:
        self._staged = None

    def commit(self, manifest: WeightsManifest) -> None:
        staged, self._staged = self._staged, None
        if staged is None:
            raise WeightsError("commit() before begin()")
        if manifest.version != self._pending_version:
            raise WeightsError(
                f"commit of v{manifest.version} for a begin(v{self._pending_version})"
            )
        verify(staged, manifest)
        self.apply(staged, manifest.version)
        self.version = manifest.version

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError


def verify(named: list[tuple[str, torch.Tensor]], manifest: WeightsManifest) -> None:
    """Raise WeightsError unless `named` is exactly what the manifest describes: every name
    once, in the manifest's order, with its shape, and (when it has one) the same checksum."""
    match_named_tensors(
        named,
        dict(zip(manifest.names, manifest.shapes, strict=True)),
        floating_point=False,
        receiver="the manifest",
        rejected=f"export v{manifest.version} altered or incomplete",
    )
    if tuple(name for name, _ in named) != manifest.names:
        raise WeightsError(f"export v{manifest.version}: names arrived out of the manifest's order")
    if manifest.checksum and checksum_of(named) != manifest.checksum:
        raise WeightsError(
            f"export v{manifest.version}: checksum mismatch, the bytes changed in transit"
        )


class HFModelSink(StagingSink):
    """An in-process transformers model (the embedded generator): copied into in place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        copy_into_module(
            self.model,
            named,
            rejected="the receiving model rejected the weights, nothing was copied",
        )
        self.model.policy_version = version


class GeneratorSink(StagingSink):
    """A rollout generator (titan_learner.rollout): verified, then `load_weights` at once."""

    def __init__(self, generator) -> None:
        super().__init__()
        self.generator = generator

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.generator.load_weights(named, version)


class SafetensorsDirSink:
    """A directory transformers and vLLM load: shards, index, config.json and the version.

    Each export is written to a fresh sibling directory `<name>.v<version>`; `<name>` is a
    symlink swapped with one atomic rename at commit, so a reader sees the old or the new
    weights, never a mix. The previous version's directory is removed after the swap.
    """

    def __init__(self, directory: str | os.PathLike, config: PretrainedConfig) -> None:
        self.link = Path(directory)
        self.config = config
        self._target: Path | None = None
        self._files: dict[str, str] = {}
        self._written: list[tuple[str, torch.Tensor]] = []
        if self.link.exists() and not self.link.is_symlink():
            raise FileExistsError(
                f"{self.link} exists and is not a titan_learner export link; "
                "choose a new directory (exports are versioned siblings behind a symlink)"
            )

    def begin(self, version: int) -> None:
        self._target = self.link.parent / f"{self.link.name}.v{version}.tmp"
        shutil.rmtree(self._target, ignore_errors=True)
        self._target.mkdir(parents=True)
        self._version = version
        self._files, self._written = {}, []

    def write(self, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        if self._target is None:
            raise WeightsError("write() before begin()")
        tied = getattr(self.config, "tie_word_embeddings", False)
        tensors = {n: t.contiguous() for n, t in bucket if not (tied and n == TIED_HF_PAIR[1])}
        self._written.extend(bucket)
        if not tensors:
            return
        filename = f"model-{len(set(self._files.values())) + 1:05d}.safetensors"
        save_file(tensors, self._target / filename, metadata={"format": "pt"})
        self._files.update(dict.fromkeys(tensors, filename))

    def abort(self) -> None:
        if self._target is not None:
            shutil.rmtree(self._target, ignore_errors=True)
        self._target = None

    def commit(self, manifest: WeightsManifest) -> None:
        target, self._target = self._target, None
        if target is None:
            raise WeightsError("commit() before begin()")
        try:
            verify(self._written, manifest)
            self._write_metadata(target, manifest)
            final = target.with_name(target.name.removesuffix(".tmp"))
            shutil.rmtree(final, ignore_errors=True)
            target.rename(final)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        previous = self.link.resolve() if self.link.is_symlink() else None
        swap = self.link.with_name(f"{self.link.name}.swap")
        swap.unlink(missing_ok=True)
        swap.symlink_to(final.name)
        os.replace(swap, self.link)
        if previous is not None and previous != final.resolve():
            shutil.rmtree(previous, ignore_errors=True)
        self._written = []

    def _write_metadata(self, target: Path, manifest: WeightsManifest) -> None:
        self.config.save_pretrained(target)
        index = {"metadata": {"total_size": _total_bytes(self._written)}, "weight_map": self._files}
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (target / "titan_learner.json").write_text(
            json.dumps({"policy_version": manifest.version, "checksum": manifest.checksum})
        )


def _total_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def read_export_version(directory: str | os.PathLike) -> int:
    """The policy version of the export a safetensors directory currently serves."""
    return int(json.loads((Path(directory) / "titan_learner.json").read_text())["policy_version"])


def push_weights(
    learner: Learner,
    sink: WeightSink,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    cpu_offload: bool = True,
    checksum: bool = True,
    adapters: bool = False,
) -> WeightsManifest:
    """Export the learner's weights into `sink`; a collective on every rank.

    cpu_offload=True: rank 0 feeds its sink (CPU tensors); False: every rank feeds its own
    sink with tensors on the learner's device (e.g. one embedded generator per rank).
    adapters=True: a LoRA learner's adapters alone (PEFT names), for engines serving them.

    If the sink fails midway, rank 0 keeps iterating so the other ranks' gathers complete (no
    hang), then aborts the sink and raises; the receiver keeps its previous weights.
    """
    export = learner.iter_weights(
        bucket_bytes=bucket_bytes,
        dtype=dtype,
        cpu_offload=cpu_offload,
        checksum=checksum,
        adapters=adapters,
    )
    feeding = export.keep
    failure: BaseException | None = None
    if feeding:
        sink.begin(learner.policy_version)
    for bucket in export:
        if feeding and failure is None:
            try:
                sink.write(bucket)
            except Exception as err:
                failure = err
    if feeding:
        if failure is not None:
            sink.abort()
            raise WeightsError(f"weight transfer failed midway: {failure}") from failure
        try:
            sink.commit(export.manifest)
        except BaseException:
            sink.abort()
            raise
    return export.manifest
