"""Push the learner's exported weights into TorchRL's vLLM engines (a sink, see titan_learner.weights.sinks).

vLLM's own RL API (an in-process `vllm.LLM`, `vllm serve`) is reached through
the rest of titan_learner.vllm (`VLLMGenerator`, `VLLMEngineSink`); this module is TorchRL's way in, a sink
with the `WeightSink` interface (begin -> write(bucket)... -> commit(manifest) | abort):

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

What is atomic, and what is not:

- Nothing is sent to an engine unless the whole export arrived and matches the manifest (names,
  shapes, xxh3 checksum of the bytes). A failed or aborted export before that point leaves the
  engine serving its previous weights.
- The manifest is verified on the learner side, before the broadcast: vLLM's NCCL
  receiver loads each tensor into the model as it arrives, so the engine cannot verify before it
  swaps. The broadcast itself is not checksummed on the receiving side (NCCL delivers or fails).
  TorchRL puts the engines to sleep (`sleep(level=0)`) before the broadcast and wakes their
  scheduling after it, so no new work is scheduled while tensors are replaced; what happens to
  requests already running at that moment is vLLM's sleep semantics, not checked here. A
  broadcast that fails midway is not rolled back: the engine may hold a mix of old and new
  tensors; the sink then raises, sets `version` to None and `consistent` to False, and the next
  successful push repairs it.
- TorchRL resets the engine's prefix cache inside its update.

vllm is never imported here at module level; TorchRL's vLLM modules import it lazily themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from titan_learner.dtypes import DTYPES
from titan_learner.model.hf_config import hf_parameter_shapes
from titan_learner.weights.export import TIED_HF_PAIR
from titan_learner.weights.matching import WeightsError, match_named_tensors
from titan_learner.weights.sinks import StagingSink

EngineMetadata = dict[str, tuple[torch.dtype, torch.Size]]
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
        "NCCLTrainerSendWeightsArgs); use VLLMEngineSink (vLLM's own RL API) with this vLLM"
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
