"""What a vLLM engine starts from (titan_learner.vllm.engine_model): the run's HF directory, or,
for a model built from scratch, the learner's config.json alone with vLLM's dummy weights; and
the head widths vLLM's CPU attention takes, refused in one line before any engine starts."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from tests.support.servers import TEST_TOKEN, run_serve
from tests.support.vllm import needs_vllm
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.model.hf_config import hf_parameter_shapes, learner_hf_config
from titan_learner.vllm.auth import TOKEN_ENV
from titan_learner.vllm.engine_model import check_cpu_head_dim, config_only_directory, engine_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOY, TOY_SERVERS = CONFIGS / "toy_grpo.toml", CONFIGS / "toy_grpo_servers.toml"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_model_built_from_scratch_starts_its_engines_from_its_config_alone(cache):
    from transformers import AutoConfig

    config = load_config(str(TOY_SERVERS))
    path, arguments = engine_model(config)
    assert arguments == {"load_format": "dummy"}
    directory = Path(path)
    assert directory.parent == cache / "titan_learner" / "engine_models"
    assert [p.name for p in directory.iterdir()] == ["config.json"], "no weights, no temp file"
    served = AutoConfig.from_pretrained(path)
    assert served.architectures == ["LlamaForCausalLM"] and served.head_dim == 32
    assert hf_parameter_shapes(served) == hf_parameter_shapes(learner_hf_config(config))


def test_the_directory_is_one_per_model_and_written_once(cache):
    first, _ = engine_model(load_config(str(TOY_SERVERS)))
    written = (Path(first) / "config.json").stat().st_mtime_ns
    again, _ = engine_model(load_config(str(TOY_SERVERS), overrides=["run.seed=7"]))
    assert again == first and (Path(first) / "config.json").stat().st_mtime_ns == written
    deeper, _ = engine_model(
        load_config(str(TOY_SERVERS), overrides=["model.overrides.n_layers=3"])
    )
    assert deeper != first
    assert json.loads((Path(deeper) / "config.json").read_text())["num_hidden_layers"] == 3


def test_a_damaged_config_in_the_cache_is_written_again(cache):
    hf_config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    directory = config_only_directory(hf_config)
    (directory / "config.json").write_text('{"hidden_size": ')  # a half-written file
    assert config_only_directory(hf_config) == directory
    assert json.loads((directory / "config.json").read_text()) == hf_config
    assert sorted(os.listdir(directory)) == ["config.json"]


def test_a_run_with_a_model_directory_serves_it_as_it_is():
    config = load_config(str(TOY_SERVERS), overrides=['rollout.model_path="engine"'])
    assert engine_model(config) == ("engine", {})


CPU_HEADS = (
    "vLLM's CPU attention takes head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 and "
    "this model's is 16; allowed: a model with one of them ([model.overrides] dim / n_heads, or "
    "head_dim for qwen3), "
)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="engines on this machine run on its GPU")
def test_a_head_width_the_cpu_attention_does_not_take_is_one_line():
    check_cpu_head_dim(load_config(str(TOY_SERVERS)))  # head_dim 32
    with pytest.raises(ConfigError) as info:
        check_cpu_head_dim(load_config(str(TOY)))  # head_dim 16
    assert str(info.value) == (
        f'{TOY}: [rollout] generator: {CPU_HEADS}generator = "hf", or rollout servers on GPUs'
    )


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="a server here would run on its GPU")
def test_serving_on_cpu_a_model_of_a_head_width_it_cannot_run_is_one_line():
    done = run_serve(TOY, "--set", 'rollout.generator="vllm"', "--dry-run")
    assert done.returncode == 2
    assert done.stderr == f"error: {TOY}: [rollout] generator: {CPU_HEADS}or a server on GPUs\n"


def test_serving_a_model_built_from_scratch_starts_vllm_on_dummy_weights(cache):
    env = {**os.environ, TOKEN_ENV: TEST_TOKEN, "XDG_CACHE_HOME": str(cache)}
    done = run_serve(TOY_SERVERS, "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[argv.index("--load-format") + 1] == "dummy"
    model = Path(argv[argv.index("--model") + 1])
    assert model.parent == cache / "titan_learner" / "engine_models"
    assert json.loads((model / "config.json").read_text())["head_dim"] == 32
