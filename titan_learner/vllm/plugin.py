"""Our weight-transfer backends, registered with vLLM's factories: `gloo` (both sides) and the
workers' side of `nccl_checked` (`nccl_worker`; its trainer side is built by `nccl_rendezvous`).

`register` is the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls it in every
one of its processes (API server, engine core, workers) before it builds a worker, so an engine
started with `weight_transfer_config={"backend": "gloo"}` finds the backend without any code of
ours on its command line. The trainer calls it too before it asks the trainer factory. vLLM may
load plugins more than once in a process: registering is idempotent. It also makes a refused
weight update one line in that process's log (`refusals`), drops the warning vLLM's reload logs
for the rotary embedding on every update (`reload_log`), on a CPU platform keeps vLLM's
processes from spinning a core the trainer needs while they wait (`cpu_spin`), and makes each
engine core exit when the process that started it dies, SIGKILL included (`orphan_guard`), and
makes a trainer's engine stop when that trainer stops it, not on the SIGTERM Slurm sends every
process of a job before the trainer has saved (`parent_signals`).
"""

from __future__ import annotations

GLOO = "gloo"
NCCL_CHECKED = "nccl_checked"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from titan_learner.vllm.cpu_spin import cap_busy_wait
    from titan_learner.vllm.orphan_guard import exit_with_parent
    from titan_learner.vllm.parent_signals import take_signals_from_parent
    from titan_learner.vllm.refusals import quiet_refusals
    from titan_learner.vllm.reload_log import quiet_rotary_reload

    quiet_refusals()
    quiet_rotary_reload()
    cap_busy_wait()
    exit_with_parent()
    take_signals_from_parent()

    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            GLOO, "titan_learner.vllm.gloo_engine", "GlooWeightTransferEngine"
        )
    if NCCL_CHECKED not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            NCCL_CHECKED, "titan_learner.vllm.nccl_worker", "CheckedNCCLWeightTransferEngine"
        )
    if GLOO not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            GLOO, "titan_learner.vllm.gloo_trainer", "GlooTrainerWeightTransferEngine"
        )
