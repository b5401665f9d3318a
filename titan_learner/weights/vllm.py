"""Push the learner's exported weights into running vLLM engines (sinks, see titan_learner.weights.sinks).

Two sinks with the `WeightSink` interface (begin -> write(bucket)... -> commit(manifest) | abort),
for the two ways weights can enter a running engine:

`VLLMSink`: TorchRL's `VLLMWeightSender` (torchrl.weight_update.llm.VLLMWeightSyncScheme with
    strategy "state_dict"; refused at construction while the installed vLLM lacks the API
    TorchRL 0.14.1 calls, as vLLM 0.32 does: `torchrl_nccl_problem`), or any TorchRL sender with
    `update_weights`. TorchRL's sender drives vLLM's native NCCL weight-transfer API (vLLM >= 0.17,
    `WeightTransferConfig(backend="nccl")`) on TorchRL `AsyncVLLM` engines: N replicas x TP GPUs,
    Ray actors. TorchRL ships both sides: the trainer side (`VLLMCollectiveTransport`: puts the
    engines to sleep, broadcasts every tensor over NCCL, resets prefix caches, wakes them) and the
    engine side (the engine actors' `init_weight_transfer_engine` / `update_weights_native`, which
    run vLLM's own receiver and `model.load_weights`). No worker extension is needed.
    The sink stages one export, verifies it against the manifest, checks it against what the
    engine loads (`engine_metadata`: names, shapes, dtype), casts it to the engine dtype and hands
    TorchRL one flat `{hf_name: tensor}` dict ordered like the metadata.

`VLLMRPCSink`: `collective_rpc` on a `vllm.LLM` built with `worker_extension_cls=WORKER_EXTENSION`
    (`VLLMSinkWorkerExtension`, below: TorchRL ships no equivalent). Buckets are streamed to every
    worker as they are exported (learner memory: one bucket); each worker verifies its staged
    copy against the manifest with `titan_learner.weights.sinks.verify` and only when every worker has
    verified does any worker swap. Every worker holds the whole export in host memory until
    the swap, and every byte crosses vLLM's RPC serialization as bytes (`rpc_transport`): sized
    for small and medium models. The swap is vLLM's in-place `reload_weights`.

What is atomic, and what is not:

- Both sinks: nothing is sent to an engine (VLLMSink) or swapped in (VLLMRPCSink) unless the
  whole export arrived and matches the manifest (names, shapes, xxh3 checksum of the bytes).
  A failed or aborted export before that point leaves the engine serving its previous weights.
- VLLMSink: the manifest is verified on the learner side, before the broadcast: vLLM's NCCL
  receiver loads each tensor into the model as it arrives, so the engine cannot verify before it
  swaps. The broadcast itself is not checksummed on the receiving side (NCCL delivers or fails).
  TorchRL puts the engines to sleep (`sleep(level=0)`) before the broadcast and wakes their
  scheduling after it, so no new work is scheduled while tensors are replaced; what happens to
  requests already running at that moment is vLLM's sleep semantics, not checked here. A
  broadcast that fails midway is not rolled back: the engine may hold a mix of old and new
  tensors; the sink then raises, sets `version` to None and `consistent` to False, and the next
  successful push repairs it.
- VLLMRPCSink: the check happens on the receiving side, in every worker, on the bytes received,
  and is two-phase across workers (all verify, then all swap). The swap itself
  (`model.load_weights`, tensor by tensor) is not atomic in memory: on `vllm.LLM` it runs between
  `generate` calls (nothing in flight), so generation sees old or new weights, never a mix; on an
  engine serving requests concurrently (AsyncLLM) pause generation around `commit`. A swap that
  fails midway (e.g. CUDA OOM) leaves a mix; the sink reports it as above.
- Neither sink changes the engine's prefix cache before the swap; both reset it after (TorchRL
  does it inside its update; VLLMRPCSink calls `reset_prefix_cache()` on the engine).

vllm is never imported here at module level; TorchRL's vLLM modules import it lazily themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from titan_learner.dtypes import DTYPES
from titan_learner.model.hf_config import hf_parameter_shapes
from titan_learner.rollout.vllm import VLLMWeightLoader
from titan_learner.weights.export import TIED_HF_PAIR, Bucket, WeightsManifest
from titan_learner.weights.matching import WeightsError, match_named_tensors
from titan_learner.weights.rpc_transport import PackedTensor, pack_tensors, unpack_tensors
from titan_learner.weights.sinks import StagingSink, verify

log = logging.getLogger(__name__)

EngineMetadata = dict[str, tuple[torch.dtype, torch.Size]]
WORKER_EXTENSION = f"{__name__}.VLLMSinkWorkerExtension"
ENGINE_DTYPES = tuple(DTYPES.values())


def check_engine_dtype(dtype: Any) -> torch.dtype:
    """The dtype a vLLM engine serves in: bfloat16, float16 or float32."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype ({', '.join(map(str, ENGINE_DTYPES))}), "
            f"got {type(dtype).__name__} {dtype!r}"
        )
    if dtype not in ENGINE_DTYPES:
        raise ValueError(
            f"dtype {dtype} is not an engine dtype; allowed: {', '.join(map(str, ENGINE_DTYPES))}"
        )
    return dtype


def engine_metadata(config: Any, dtype: torch.dtype) -> EngineMetadata:
    """`{hf_name: (dtype, shape)}` for every parameter the engine loads, from a transformers config.

    Built on the meta device (no memory). A tied `lm_head.weight` is left out (vLLM's llama and
    qwen3 loaders skip it when `tie_word_embeddings`); it is the format TorchRL's
    `VLLMWeightSender.init_all_workers_group` takes.
    """
    check_engine_dtype(dtype)
    shapes, required = hf_parameter_shapes(config)
    return {name: (dtype, torch.Size(shapes[name])) for name in required}


def check_metadata(metadata: Mapping[str, tuple[torch.dtype, torch.Size]]) -> EngineMetadata:
    if not isinstance(metadata, Mapping) or not metadata:
        raise ValueError("metadata must be a non-empty mapping {hf_name: (dtype, shape)}")
    checked: EngineMetadata = {}
    for name, entry in metadata.items():
        if not isinstance(name, str) or not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError(f"metadata[{name!r}] must be (dtype, shape), got {entry!r}")
        dtype, shape = entry
        checked[name] = (check_engine_dtype(dtype), torch.Size(shape))
    return checked


def engine_weights(
    named: Iterable[tuple[str, torch.Tensor]], metadata: EngineMetadata
) -> dict[str, torch.Tensor]:
    """The flat mapping handed to TorchRL: `{hf_name: tensor}` in metadata order, each tensor
    cast to its metadata dtype (a no-op when the export already has it).

    Every metadata name must be present with its shape; a name outside the metadata is accepted
    only as the tied alias of one inside it with equal values (it is dropped). Raises
    WeightsError, naming each problem, before anything is cast or sent.
    """
    pairs = (TIED_HF_PAIR, TIED_HF_PAIR[::-1])
    received = match_named_tensors(
        named,
        {name: shape for name, (_, shape) in metadata.items()},
        tied={alias: p for alias, p in pairs if alias not in metadata and p in metadata},
        receiver="the engine",
        rejected="the export does not match the engine, nothing was sent",
    )
    return {
        name: received[name].detach().to(dtype).contiguous()
        for name, (dtype, _) in metadata.items()
    }


def torchrl_nccl_problem() -> str | None:
    """Why TorchRL's NCCL weight sync cannot reach the installed vLLM, or None if it can.

    TorchRL 0.14.1's `VLLMWeightSender` drives `NCCLWeightTransferEngine.trainer_init`,
    `trainer_send_weights` and `NCCLTrainerSendWeightsArgs`; vLLM 0.32 moved the trainer side
    to `NCCLTrainerWeightTransferEngine` with other arguments. Against such a vLLM the sender
    would wait out its 300 s store timeout (a hang, then a traceback), so it is refused instead.
    """
    try:
        import vllm
        from vllm.distributed.weight_transfer import nccl_engine
    except ImportError:
        return "TorchRL's NCCL weight sync needs vllm, which is not installed"
    engine = getattr(nccl_engine, "NCCLWeightTransferEngine", None)
    if hasattr(engine, "trainer_init") and hasattr(nccl_engine, "NCCLTrainerSendWeightsArgs"):
        return None
    import torchrl

    return (
        f"TorchRL {torchrl.__version__}'s NCCL weight sync calls vLLM APIs that vllm "
        f"{vllm.__version__} no longer has (NCCLWeightTransferEngine.trainer_init, "
        "NCCLTrainerSendWeightsArgs); use VLLMRPCSink (collective_rpc) with this vLLM"
    )


class VLLMSink(StagingSink):
    """A `WeightSink` into vLLM engines through a TorchRL vLLM weight sender (see module doc).

    `sender` is TorchRL's `VLLMWeightSender` (from `VLLMWeightSyncScheme(strategy="state_dict")`),
    already joined to the engines with `init_all_workers_group(metadata, vllm_engine=engine)`, or
    any TorchRL sender with `update_weights(weights)` that takes a flat name -> tensor dict. (The
    CPU tests use `VLLMDoubleBufferWeightSender`, which memmaps the dict into one directory,
    overwritten in place: a reader can see a mix, so SafetensorsDirSink is the file transport to
    use.) `metadata` is what the engine loads, the same mapping the sender was initialized with
    (`engine_metadata(config, dtype)`).

    The sink holds one export (learner dtype) until commit; exporting in the engine dtype
    (`push_weights(..., dtype=engine dtype)`) avoids a second, cast copy at commit.
    """

    def __init__(self, sender: Any, metadata: Mapping[str, tuple[torch.dtype, torch.Size]]):
        if not callable(getattr(sender, "update_weights", None)):
            raise TypeError(
                f"sender must be a TorchRL weight sender with update_weights(weights), "
                f"got {type(sender).__name__}"
            )
        from torchrl.weight_update.llm import VLLMWeightSender

        if isinstance(sender, VLLMWeightSender) and (problem := torchrl_nccl_problem()):
            raise WeightsError(problem)
        super().__init__()
        self.sender = sender
        self.metadata = check_metadata(metadata)
        self.consistent = True

    @classmethod
    def for_async_vllm(
        cls,
        engine: Any,
        config: Any,
        dtype: torch.dtype,
        *,
        master_address: str = "localhost",
        master_port: int | None = None,
        device: int = 0,
    ) -> VLLMSink:
        """Join a TorchRL `AsyncVLLM` engine's NCCL weight-transfer group (a collective with the
        engine's workers: this process is rank 0 on `cuda:device`) and return its sink.

        Needs ray, a GPU for this process that no engine worker uses, and a vLLM whose NCCL
        API TorchRL's sender speaks (`torchrl_nccl_problem()`; refused at once otherwise).
        """
        from torchrl.weight_update.llm import VLLMWeightSyncScheme

        if problem := torchrl_nccl_problem():
            raise WeightsError(problem)

        metadata = engine_metadata(config, dtype)
        args = engine.engine_args
        gpus_per_replica = (
            args.tensor_parallel_size
            * getattr(args, "data_parallel_size", 1)
            * getattr(args, "pipeline_parallel_size", 1)
        )
        scheme = VLLMWeightSyncScheme(
            master_address=master_address,
            master_port=master_port,
            gpus_per_replica=gpus_per_replica,
            num_replicas=engine.num_replicas,
            strategy="state_dict",
            device=device,
        )
        sender = scheme.create_sender()
        sender.init_all_workers_group(metadata, vllm_engine=engine)
        return cls(sender, metadata)

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Send a verified export (StagingSink.commit checked it) in the engine's names/dtype."""
        weights = engine_weights(named, self.metadata)  # what the engine loads, in its dtype
        del named
        try:
            self.sender.update_weights(weights)
        except BaseException as err:
            previous, self.version, self.consistent = self.version, None, False
            raise WeightsError(
                f"sending export v{version} to the vLLM engine failed: {err}. The "
                f"engine may hold a mix of v{previous} and v{version} weights; push "
                "again before generating"
            ) from err
        self.consistent = True


# ---------------------------------------------------------------------------------------------
# collective_rpc: verified inside the engine's workers before anything is swapped


def _manifest_dict(manifest: WeightsManifest) -> dict[str, Any]:
    """The manifest as plain lists and strings (what an RPC serializer carries everywhere)."""
    return {
        "version": manifest.version,
        "names": list(manifest.names),
        "shapes": [list(shape) for shape in manifest.shapes],
        "dtypes": list(manifest.dtypes),
        "checksum": manifest.checksum,
    }


def _manifest_from_dict(data: Mapping[str, Any]) -> WeightsManifest:
    return WeightsManifest(
        version=int(data["version"]),
        names=tuple(data["names"]),
        shapes=tuple(tuple(int(d) for d in shape) for shape in data["shapes"]),
        dtypes=tuple(data["dtypes"]),
        checksum=str(data["checksum"]),
    )


class VLLMSinkWorkerExtension(VLLMWeightLoader):
    """The vLLM side of `VLLMRPCSink`: a worker extension (`worker_extension_cls=WORKER_EXTENSION`).

    Its methods run inside every vLLM worker, called by name through `collective_rpc`. A staged
    export is held in host memory until `titan_swap`, which refuses anything `titan_verify` did
    not accept for that version. It extends VLLMGenerator's `VLLMWeightLoader`, so an engine built
    with it also takes `load_hf_weights`.
    """

    _titan_staged: list[tuple[str, torch.Tensor]] | None = None
    _titan_staging_version: int | None = None
    _titan_verified_version: int | None = None
    titan_weights_version: int | None = None

    def titan_begin(self, version: int) -> None:
        self._titan_staged = []
        self._titan_staging_version = int(version)
        self._titan_verified_version = None

    def titan_stage(self, version: int, packed: list[PackedTensor]) -> int:
        """Hold one bucket (`pack_tensors` output) of export `version` until verify and swap."""
        if self._titan_staged is None or self._titan_staging_version != int(version):
            raise RuntimeError(f"titan_stage(v{version}) without titan_begin(v{version})")
        self._titan_staged.extend(unpack_tensors(packed))
        return len(self._titan_staged)

    def titan_verify(self, manifest: Mapping[str, Any]) -> str | None:
        """None when the staged export is exactly the manifest's, else why not (nothing raises
        across the RPC boundary, so every worker's answer reaches the sink)."""
        self._titan_verified_version = None
        try:
            expected = _manifest_from_dict(manifest)
            if self._titan_staged is None or self._titan_staging_version != expected.version:
                return f"no staged export v{expected.version} on this worker"
            verify(self._titan_staged, expected)
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        self._titan_verified_version = expected.version
        return None

    def titan_swap(self, version: int) -> int:
        """Load the verified staged export into the model (vLLM maps HF names onto its fused,
        TP-sliced layers and casts to its dtype), then drop the staged copy."""
        if self._titan_verified_version != int(version) or self._titan_staged is None:
            raise RuntimeError(f"titan_swap(v{version}): that export was not verified here")
        staged, self._titan_staged = self._titan_staged, None
        self._titan_verified_version = None
        loaded = self._load_into_model(staged)
        self.titan_weights_version = int(version)
        return loaded

    def titan_drop(self) -> None:
        self._titan_staged = None
        self._titan_staging_version = None
        self._titan_verified_version = None

    def titan_version(self) -> int | None:
        return self.titan_weights_version


class VLLMRPCSink:
    """A `WeightSink` into a vLLM engine through `collective_rpc` (see module doc).

    `engine` is a `vllm.LLM` (or anything whose `collective_rpc(method, args=...)` calls a worker
    method on every worker and returns their results as a list) built with
    `worker_extension_cls=WORKER_EXTENSION`. Buckets go to the workers as they are written, in
    the learner's export dtype, so that each worker checks the very bytes the manifest describes;
    the engine casts them to its dtype when it loads them.
    """

    def __init__(self, engine: Any) -> None:
        if not callable(getattr(engine, "collective_rpc", None)):
            raise TypeError(
                f"engine must have collective_rpc (a vllm.LLM), got {type(engine).__name__}"
            )
        self.engine = engine
        self.version: int | None = None
        self.consistent = True
        self._pending_version: int | None = None

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return list(self.engine.collective_rpc(method, args=args))

    def begin(self, version: int) -> None:
        self._pending_version = int(version)
        self._rpc("titan_begin", self._pending_version)

    def write(self, bucket: Bucket) -> None:
        if self._pending_version is None:
            raise WeightsError("write() before begin()")
        self._rpc("titan_stage", self._pending_version, pack_tensors(bucket))

    def abort(self) -> None:
        self._pending_version = None
        try:
            self._rpc("titan_drop")
        except Exception as err:  # the engine keeps serving its previous weights regardless
            log.warning("could not drop the staged export on the vLLM workers: %s", err)

    def commit(self, manifest: WeightsManifest) -> None:
        version, self._pending_version = self._pending_version, None
        if version is None:
            raise WeightsError("commit() before begin()")
        if manifest.version != version:
            self._rpc("titan_drop")
            raise WeightsError(f"commit of v{manifest.version} for a begin(v{version})")
        answers = self._rpc("titan_verify", _manifest_dict(manifest))
        rejected = [(rank, why) for rank, why in enumerate(answers) if why is not None]
        if rejected:
            self._rpc("titan_drop")
            rank, why = rejected[0]
            raise WeightsError(
                f"vLLM worker {rank} rejected export v{version} ({len(rejected)} of "
                f"{len(answers)} workers did), nothing was swapped: {why}"
            )
        try:
            self._rpc("titan_swap", version)
        except BaseException as err:
            previous, self.version, self.consistent = self.version, None, False
            raise WeightsError(
                f"swapping in export v{version} failed on a vLLM worker: {err}. The engine may "
                f"hold a mix of v{previous} and v{version} weights; push again before generating"
            ) from err
        reset = getattr(self.engine, "reset_prefix_cache", None)
        if callable(reset):
            reset()  # cached KV was computed with the old weights
        self.version = version
        self.consistent = True
