"""Which backend of vLLM's RL weight-transfer API `[rollout.vllm] weight_transfer` picks
(titan_learner.vllm.backends), and the one-line refusals of a backend that cannot reach the
engine. No vLLM needed: the choice is made before any engine starts."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from titan_learner.vllm.backends import WEIGHT_TRANSFERS, resolve_weight_transfer

# (requested, engine on a GPU, colocated with the trainer) -> backend
CHOSEN = {
    ("auto", False, False): "gloo",
    ("auto", False, True): "gloo",
    ("auto", True, True): "ipc",
    ("auto", True, False): "nccl",
    ("gloo", True, True): "gloo",
    ("gloo", True, False): "gloo",
    ("gloo", False, False): "gloo",
    ("ipc", True, True): "ipc",
    ("nccl", True, False): "nccl",
    ("nccl_m2n", True, False): "nccl_m2n",  # where nccl.m2n imports (below where it does not)
}

REFUSED = {
    ("nccl", False, False): "'nccl' moves weights between CUDA devices and this engine runs on "
    "the CPU; allowed here: gloo (or auto)",
    ("ipc", False, True): "'ipc' moves weights between CUDA devices",
    ("nccl_m2n", False, False): "'nccl_m2n' moves weights between CUDA devices",
    ("ipc", True, False): "'ipc' shares CUDA memory with an engine on the trainer's own GPU and "
    "this engine is elsewhere; allowed: nccl, gloo (or auto)",
    ("nccl", True, True): "'nccl' needs the engine on another GPU than the trainer's (NCCL allows "
    "one rank per device); allowed for a colocated engine: ipc, gloo (or auto)",
    ("nccl_m2n", True, True): "rollout servers' tensor-parallel layout, and this engine is an "
    "in-process vllm.LLM; allowed here: ipc, gloo (or auto)",
    ("NCCL", True, False): "weight_transfer 'NCCL' is not a backend; allowed: auto, ipc, nccl, "
    "nccl_m2n, gloo",
}


@pytest.mark.parametrize(("case", "backend"), CHOSEN.items())
def test_the_backend_chosen_for_each_engine_placement(case, backend):
    requested, on_gpu, colocated = case
    chosen = resolve_weight_transfer(
        requested, engine_on_gpu=on_gpu, colocated=colocated, m2n_runtime=True
    )
    assert chosen == backend


@pytest.mark.parametrize(("case", "message"), REFUSED.items())
def test_a_backend_that_cannot_reach_the_engine_is_refused(case, message):
    requested, on_gpu, colocated = case
    with pytest.raises(ValueError) as info:
        resolve_weight_transfer(
            requested, engine_on_gpu=on_gpu, colocated=colocated, m2n_runtime=True
        )
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_in_process_engine_over_several_gpus_takes_gloo():
    """`tensor_parallel_size = 2` on a rank's own vllm.LLM: its workers take the first GPUs
    the rank sees, the trainer's among them. NCCL would put two ranks on that device, and
    vLLM's IPC receiver wants a handle on the second worker's GPU, where the trainer has none."""
    pick = partial(resolve_weight_transfer, engine_on_gpu=True, colocated=True, gpus=2)
    assert pick("auto") == pick("gloo") == "gloo"
    for requested, message in (
        (
            "ipc",
            "weight_transfer 'ipc' shares the trainer's CUDA memory on its own GPU, and this "
            "engine's workers run on 2 GPUs (vLLM's IPC receiver wants a handle on each "
            "worker's GPU); allowed for an in-process engine over several GPUs: gloo (or auto)",
        ),
        (
            "nccl",
            "weight_transfer 'nccl' needs the engine on another GPU than the trainer's (NCCL "
            "allows one rank per device); allowed for a colocated engine: gloo (or auto)",
        ),
        (
            "nccl_m2n",
            "weight_transfer 'nccl_m2n' reshards into rollout servers' tensor-parallel "
            "layout, and this engine is an in-process vllm.LLM; allowed here: gloo (or auto)",
        ),
    ):
        with pytest.raises(ValueError) as info:
            pick(requested, m2n_runtime=True)
        assert str(info.value) == message
    on_cpu = resolve_weight_transfer("auto", engine_on_gpu=False, colocated=True, gpus=2)
    assert on_cpu == "gloo"


def test_check_sees_an_in_process_engine_over_several_gpus(monkeypatch):
    """`check` and `train` refuse what the engine would: the same rule from the config."""
    import torch

    from titan_learner.config.errors import ConfigError
    from titan_learner.config.toml import load_config
    from titan_learner.vllm.checks import _check_weight_transfer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU machine's answer
    config = load_config(
        str(Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"),
        [
            "rollout.generator=vllm",
            "rollout.vllm.tensor_parallel_size=2",
            "rollout.vllm.weight_transfer=nccl",
        ],
    )
    with pytest.raises(ConfigError) as info:
        _check_weight_transfer(config)
    assert "allowed for a colocated engine: gloo (or auto)" in str(info.value)


def test_nccl_m2n_without_its_runtime_is_refused_naming_it():
    """vLLM imports `nccl.m2n` only at the first transfer: refused before the run instead."""
    with pytest.raises(ValueError) as info:
        resolve_weight_transfer("nccl_m2n", engine_on_gpu=True, colocated=False, m2n_runtime=False)
    assert str(info.value) == (
        "weight_transfer 'nccl_m2n' needs NVIDIA's nccl-extensions (the nccl.m2n runtime, "
        "NCCL >= 2.30.5) and it does not import here; allowed: nccl, gloo (or auto)"
    )
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:  # this machine: the same refusal, found by trying the import
        with pytest.raises(ValueError, match="needs NVIDIA's nccl-extensions"):
            resolve_weight_transfer("nccl_m2n", engine_on_gpu=True, colocated=False)


def test_every_named_backend_is_chosen_or_refused_somewhere():
    named = {case[0] for case in CHOSEN} | {case[0] for case in REFUSED}
    assert set(WEIGHT_TRANSFERS) <= named
