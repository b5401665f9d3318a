"""The model from its own directory: config.json decides the architecture; flavor and overrides
may be left out and, when given, must agree with it."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_dirs import make_model_dir
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import config_from_dict
from titan_learner.learner.local import LocalLearner


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, make_model_dir(directory, request.param)


def test_a_directory_alone_gives_the_model_with_transformers_logits(model_dir):
    from transformers import AutoModelForCausalLM

    name, table = model_dir
    config = config_from_dict({"model": {"name": name, "hf_checkpoint": table["hf_checkpoint"]}})
    assert config.model.overrides.dim is None  # nothing but the directory says the shape
    learner = LocalLearner(config)
    reference = AutoModelForCausalLM.from_pretrained(table["hf_checkpoint"]).eval()
    tokens = torch.randint(
        0, table["overrides"]["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours = learner.model(tokens)
        theirs = reference(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert learner.spec.model.enable_weight_tying == reference.config.tie_word_embeddings


def test_overrides_that_disagree_with_the_directory_are_one_line(model_dir):
    name, table = model_dir
    config = config_from_dict(
        {
            "model": {
                "name": name,
                "hf_checkpoint": table["hf_checkpoint"],
                "overrides": {"dim": 32},
            }
        },
        source="run.toml",
    )
    with pytest.raises(ConfigError) as info:
        LocalLearner(config)
    assert str(info.value) == (
        f"run.toml: [model.overrides]: dim = 32 but {table['hf_checkpoint']}/config.json has "
        "hidden_size = 64; allowed: leave it out (the directory decides) or the same value"
    )
    other = "qwen3" if name == "llama3" else "llama3"
    config = config_from_dict(
        {"model": {"name": other, "hf_checkpoint": table["hf_checkpoint"]}}, source="run.toml"
    )
    with pytest.raises(
        ConfigError, match=rf"\[model\] name: name = '{other}' but .* describes a {name} model"
    ):
        LocalLearner(config)


def test_overrides_that_agree_are_accepted(model_dir):
    name, table = model_dir
    config = config_from_dict({"model": {"name": name, **table}})
    assert LocalLearner(config).vocab_size == table["overrides"]["vocab_size"]


def test_a_damaged_safetensors_file_is_named(tmp_path):
    import shutil

    directory = tmp_path / "damaged"
    source = make_model_dir(tmp_path / "model")["hf_checkpoint"]
    shutil.copytree(source, directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, as by a failed download
    config = config_from_dict({"model": {"hf_checkpoint": str(directory)}}, source="run.toml")
    with pytest.raises(ConfigError) as info:
        LocalLearner(config)
    message = str(info.value)
    assert message.startswith(
        f"run.toml: [model] hf_checkpoint: {weights} is not a readable safetensors file ("
    )
    assert message.endswith("allowed: the model directory's own, complete *.safetensors files")
