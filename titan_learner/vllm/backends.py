"""Which of vLLM's weight-transfer backends moves the learner's weights into an engine.

`[rollout.vllm] weight_transfer`: "auto" picks by where the engine runs, the rest name a
backend. ipc: CUDA IPC handles, for an engine on the trainer's own GPU (no copy leaves the
device). nccl: a broadcast to engines on other GPUs or nodes. nccl_m2n: vLLM's resharding
transfer from every trainer rank's shards straight into the servers' tensor-parallel layout
(rollout servers only; it needs NVIDIA's nccl-extensions, the `nccl.m2n` runtime, on the
trainer and the servers). gloo: ours (titan_learner.vllm.gloo_engine), a broadcast over gloo
through host memory: the one that works without a GPU, and on any engine as a fallback.

An engine that takes `nccl` from us runs our checked worker engine (`engine_backend`: vLLM's
NCCL receive, then the manifest's check before the swap, `nccl_worker`).
"""

from __future__ import annotations

WEIGHT_TRANSFERS = ("auto", "ipc", "nccl", "nccl_m2n", "gloo")
GPU_ONLY = {"ipc", "nccl", "nccl_m2n"}
ENGINE_BACKENDS = {"nccl": "nccl_checked"}  # plugin.NCCL_CHECKED


def engine_backend(transfer: str) -> str:
    """The name an engine's `weight_transfer_config` gives the backend `transfer` resolved to."""
    return ENGINE_BACKENDS.get(transfer, transfer)


def in_process_gpus(engine: dict) -> int:
    """How many GPUs an in-process `vllm.LLM` with these keyword arguments runs on: the first
    ones the rank sees, the rank's own among them."""
    return engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)


def resolve_weight_transfer(
    requested: str,
    *,
    engine_on_gpu: bool,
    colocated: bool,
    gpus: int = 1,
    m2n_runtime: bool | None = None,
) -> str:
    """The backend to use, or ValueError naming why `requested` cannot serve this engine.

    engine_on_gpu: the engine's workers run on CUDA devices. colocated: the engine shares the
    trainer process's GPU (an in-process `vllm.LLM`, on the rank's own device and, with
    `gpus` > 1, the next ones too: its tensor-parallel workers). m2n_runtime: whether
    `nccl.m2n` imports here (None: try it, then check the NCCL it would run on, `m2n_nccl`).

    An in-process engine over several GPUs takes neither GPU backend: NCCL allows one rank per
    device and its first worker shares the trainer's, and vLLM's IPC receiver wants a handle
    on every worker's own GPU where the trainer holds the weights on one. gloo serves it.
    """
    spans = colocated and engine_on_gpu and gpus > 1
    also = "gloo" if spans else "ipc, gloo"
    if requested not in WEIGHT_TRANSFERS:
        raise ValueError(
            f"weight_transfer {requested!r} is not a backend; allowed: "
            + ", ".join(WEIGHT_TRANSFERS)
        )
    if requested == "auto":
        if not engine_on_gpu or spans:
            return "gloo"
        return "ipc" if colocated else "nccl"
    if requested in GPU_ONLY and not engine_on_gpu:
        raise ValueError(
            f"weight_transfer {requested!r} moves weights between CUDA devices and this engine "
            "runs on the CPU; allowed here: gloo (or auto)"
        )
    if requested == "ipc" and not colocated:
        raise ValueError(
            "weight_transfer 'ipc' shares CUDA memory with an engine on the trainer's own GPU "
            "and this engine is elsewhere; allowed: nccl, gloo (or auto)"
        )
    if requested == "ipc" and spans:
        raise ValueError(
            f"weight_transfer 'ipc' shares the trainer's CUDA memory on its own GPU, and this "
            f"engine's workers run on {gpus} GPUs (vLLM's IPC receiver wants a handle on each "
            "worker's GPU); allowed for an in-process engine over several GPUs: gloo (or auto)"
        )
    if requested == "nccl" and colocated:
        raise ValueError(
            "weight_transfer 'nccl' needs the engine on another GPU than the trainer's (NCCL "
            f"allows one rank per device); allowed for a colocated engine: {also} (or auto)"
        )
    if requested == "nccl_m2n" and colocated:
        raise ValueError(
            "weight_transfer 'nccl_m2n' reshards into rollout servers' tensor-parallel layout, "
            f"and this engine is an in-process vllm.LLM; allowed here: {also} (or auto)"
        )
    if requested == "nccl_m2n" and not (_m2n_imports() if m2n_runtime is None else m2n_runtime):
        raise ValueError(
            "weight_transfer 'nccl_m2n' needs NVIDIA's nccl-extensions (the nccl.m2n runtime, "
            "NCCL >= 2.30.5) and it does not import here; allowed: nccl, gloo (or auto)"
        )
    if requested == "nccl_m2n" and m2n_runtime is None:
        from titan_learner.vllm.m2n_nccl import check_m2n_nccl

        check_m2n_nccl()  # one libnccl for vLLM and m2n, new enough
    return requested


def _m2n_imports() -> bool:
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:
        return False
    return True
