"""[model.lora] on one process: TorchTitan's LoRAConverter in the one build path, only the
adapters trained, the merged export against the formula and transformers, the KL reference
with the adapters off against a frozen copy, and checkpoints of the adapters alone.

Sharded LoRA steps are compared with these one-process ones in test_parity.py (dp_shard=2,
accumulation, dp x tp, HSDP: values and every adapter gradient)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from tests.support.models import batches, learner_logits, tiny_config, tokens
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.hf_export import export_checkpoint
from titan_learner.checkpoint.model_weights import saved_model_shapes
from titan_learner.checkpoint.safe_read import read_metadata
from titan_learner.cli import main
from titan_learner.cli.check import plan, render
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.job.reference import ReferenceModel
from titan_learner.job.validate import validate
from titan_learner.learner.local import LocalLearner
from titan_learner.model.build import build_model
from titan_learner.model.hf_config import hf_config
from titan_learner.model.initial_state import load_full_state
from titan_learner.model.lora import adapters_off
from titan_learner.model.spec import build_meta, model_spec
from titan_learner.weights.lora import SCALING, is_adapter, lora_modules

LORA = {"rank": 4, "alpha": 8.0}
TOY = str(Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml")
F32 = torch.float32


def lora_config(lora: dict | None = None, **sections):
    return tiny_config(model={"lora": {**LORA, **(lora or {})}}, **sections)


@pytest.fixture(scope="module")
def trained():
    """A LoRA learner after three GRPO updates: both adapters of every layer have moved."""
    learner = LocalLearner(lora_config())
    base = {k: v.clone() for k, v in learner.model.state_dict().items() if not is_adapter(k)}
    for batch in batches(3):
        learner.update(batch)
    return learner, base


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            {"target_modules": ["wq", "w1"]},
            "tests: [model.lora] target_modules: 'wq' matches no Linear of the llama3 model; "
            "allowed: one or more of lm_head, w1, w2, w3, wo, wqkv (q, k and v are one fused "
            "Linear, wqkv)",
        ),
        (
            {"target_modules": []},
            "tests: [model.lora] target_modules: no target of the llama3 model; allowed: one or "
            "more of lm_head, w1, w2, w3, wo, wqkv (q, k and v are one fused Linear, wqkv)",
        ),
        ({"rank": 0}, "tests: [model.lora] rank: 0 is out of range; allowed: >= 1"),
        ({"alpha": 0.0}, "tests: [model.lora] alpha: 0.0 is not allowed; allowed: > 0"),
    ],
)
def test_bad_lora_settings_are_one_line_before_any_compute(lora, message):
    with pytest.raises(ConfigError) as info:
        validate(lora_config(lora), 1, on_this_machine=False, job=False)
    assert str(info.value) == message


def test_a_tied_output_head_is_no_lora_target():
    config = tiny_config("qwen3", model={"lora": {**LORA, "target_modules": ["wo", "lm_head"]}})
    assert config.model.name == "qwen3"
    with pytest.raises(ConfigError) as info:
        validate(config, 1, on_this_machine=False, job=False)
    assert str(info.value) == (
        "tests: [model.lora] target_modules: lm_head shares its weight with the embedding in "
        "this qwen3 model (tied), which Hugging Face's format and vLLM keep as one tensor; "
        "allowed: targets other than lm_head (w1, w2, w3, wo, wqkv)"
    )


def test_torchtitan_lora_layers_hold_the_scale_we_read_and_set():
    """Guards TorchTitan's private `_lora_scaling` (adapters_off and the merged export use it):
    alpha / rank on every target, none on the output head (not a target by default)."""
    config = lora_config({"alpha": 6.0})
    model = build_meta(model_spec(config.model, "sdpa"))
    adapted = dict(lora_modules(model))
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    assert suffixes == ["w1", "w2", "w3", "wo", "wqkv"]
    assert all(getattr(module, SCALING) == 6.0 / 4 for module in adapted.values())
    assert not hasattr(model.lm_head, SCALING)
    chosen = lora_config({"target_modules": ["wo", "lm_head"]})
    names = [n for n, _ in lora_modules(build_meta(model_spec(chosen.model, "sdpa")))]
    assert names == ["layers.0.attention.wo", "layers.1.attention.wo", "lm_head"]


def test_only_the_adapters_train_and_the_base_stays_bit_identical(trained):
    learner, base = trained
    optimized = {
        id(p) for o in learner.optimizer.optimizers for g in o.param_groups for p in g["params"]
    }
    names = [n for n, p in learner.model.named_parameters() if id(p) in optimized]
    assert names and all(is_adapter(n) for n in names)
    assert len(names) == 2 * len(list(lora_modules(learner.model)))
    after = learner.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert all(float(after[n].abs().max()) > 0 for n in names if ".lora_b." in n)


def test_the_merged_export_is_the_formula_and_serves_in_transformers(trained):
    learner, _ = trained
    exported = dict(learner.get_weights(dtype=F32).items())
    assert not any("lora" in name for name in exported)
    # W + alpha / rank * B A, by hand, for a layer the HF names leave unpermuted
    w1 = learner.model.layers["1"].feed_forward.w1
    by_hand = w1.weight + (LORA["alpha"] / LORA["rank"]) * w1.lora_b.weight @ w1.lora_a.weight
    got = exported["model.layers.1.mlp.gate_proj.weight"]
    torch.testing.assert_close(got, by_hand.detach(), atol=1e-6, rtol=0)
    assert not torch.allclose(got, w1.weight.detach(), atol=1e-4)  # the adapters count
    model = LlamaForCausalLM(hf_config(learner.spec)).float().eval()
    model.load_state_dict(exported, strict=True)
    with torch.no_grad():
        served = model(tokens()).logits
    torch.testing.assert_close(served, learner_logits(learner, tokens()), atol=1e-5, rtol=0)


def test_the_kl_reference_is_the_base_with_the_adapters_off_equal_to_a_frozen_copy(trained):
    """In the learner's own model (no second copy of the weights); the frozen copy is a model
    without LoRA holding the same base weights."""
    learner, base = trained
    config = learner.config
    batch = batches(1, varied=True)[0]
    reference = ReferenceModel.base_of(config, learner.model, learner.device)
    plain_config = tiny_config()
    copy = build_model(plain_config, sharded=False, initial_weights=False).model.eval()
    load_full_state(copy, base)
    frozen = ReferenceModel.base_of(plain_config, copy, torch.device("cpu"))  # nothing to switch
    got, want = reference.kl_log_probs(batch), frozen.kl_log_probs(batch)
    assert torch.equal(got, want)
    # the adapters are back on afterwards: the learner's logits are the adapted model's
    assert all(getattr(m, SCALING) == 2.0 for _, m in lora_modules(learner.model))
    assert not torch.allclose(
        learner_logits(learner, tokens()), learner_logits_of(copy, tokens()), atol=1e-4
    )


def learner_logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).float()


def test_a_checkpoint_holds_the_adapters_and_resumes_exactly_on_the_same_base(trained, tmp_path):
    learner, _ = trained
    learner.save(str(tmp_path / "lora"))
    saved = saved_model_shapes(read_metadata(tmp_path / "lora" / "step-3"))
    assert sorted(saved) == sorted(n for n in learner.model.state_dict() if is_adapter(n))
    resumed = LocalLearner(lora_config())
    resumed.load(str(tmp_path / "lora"))
    assert resumed.step == 3
    for key, value in learner.get_weights(dtype=F32).items():
        assert torch.equal(resumed.get_weights(dtype=F32)[key], value), key
    nxt = batches(4)[3]
    assert dict(resumed.update(nxt.clone()).items()) == dict(learner.update(nxt.clone()).items())


def test_adapters_are_refused_on_another_base_before_anything_is_read(trained, tmp_path):
    learner, _ = trained
    learner.save(str(tmp_path / "lora"))
    other = LocalLearner(lora_config(run={"seed": 1}))  # another seeded base
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        other.load(str(tmp_path / "lora"))
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'lora'} holds LoRA adapters trained on another base model "
        f"(seeded initial weights, fingerprint {learner.base_fingerprint}); this run's base is "
        f"the seeded initial weights (fingerprint {other.base_fingerprint}); allowed: the same "
        "[model] hf_checkpoint weights, or a new output_dir"
    )
    assert all(torch.equal(other.model.state_dict()[k], v) for k, v in before.items())


def test_a_lora_checkpoint_is_a_small_fraction_of_a_full_one(trained, tmp_path):
    learner, _ = trained
    full = LocalLearner(tiny_config())
    full.update(batches(1)[0])
    learner.save(str(tmp_path / "lora"))
    full.save(str(tmp_path / "full"))

    def size(root):
        return sum(f.stat().st_size for f in (root).rglob("*.distcp"))

    ratio = size(tmp_path / "lora") / size(tmp_path / "full")
    print(f"LoRA checkpoint / full checkpoint: {ratio:.3f}")
    assert ratio < 0.25, ratio


def test_check_counts_trainable_and_frozen_parameters_and_their_memory():
    """`check` on the embedded default with [model.lora]: the adapters are what has gradients
    and Adam moments; the KL reference is the base itself, so no frozen copy is held for it."""
    kl = ["loss.kl_to_ref_coeff=0.1"]
    config = load_config(TOY, ["model.lora.rank=8", *kl])
    learner = LocalLearner(config)
    optimized = [
        p for o in learner.optimizer.optimizers for g in o.param_groups for p in g["params"]
    ]
    adapters = sum(p.numel() for p in optimized)
    total = sum(p.numel() for p in learner.model.parameters())
    p = plan(config, 1)
    assert (p.validated.trainable, p.validated.parameters) == (adapters, total)
    assert p.bytes_per_rank == {
        "parameters": 4 * total,
        "gradients": 4 * adapters,
        "optimizer": 8 * adapters,
    }
    assert (
        f"trainable: {adapters:,} (0.02 M, the LoRA adapters); frozen: {total - adapters:,} "
        "(0.13 M)" in render(config, p)
    )
    full = plan(load_config(TOY, kl), 1)
    assert full.bytes_per_rank["frozen"] == full.bytes_per_rank["parameters"]
    assert "trainable:" not in render(config, full)


def test_export_of_a_lora_checkpoint_is_the_merged_model_on_its_base(trained, tmp_path):
    learner, _ = trained
    learner.save(str(tmp_path / "lora"))
    out = export_checkpoint(tmp_path / "lora", tmp_path / "hf", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        served = model(tokens()).logits
    torch.testing.assert_close(served, learner_logits(learner, tokens()), atol=1e-5, rtol=0)
    moved = tmp_path / "other_base.toml"
    moved.write_text(
        (tmp_path / "lora" / "config.toml").read_text().replace("seed = 0", "seed = 5")
    )
    with pytest.raises(CheckpointError, match="holds LoRA adapters trained on another base"):
        export_checkpoint(tmp_path / "lora", tmp_path / "hf2", config=moved)
    assert not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_the_adapter_export_is_a_peft_directory_peft_loads_with_the_merged_logits(name, tmp_path):
    """`export --adapter`: PEFT's names and config; PeftModel over the base gives the logits of
    the merged model (the fused QKV adapter split into q, k and v, llama's q/k permutation)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    learner = LocalLearner(tiny_config(name, model={"lora": LORA}))
    for batch in batches(2):
        learner.update(batch)
    learner.save(str(tmp_path / "lora"))
    code = main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "lora"),
            "--out",
            str(tmp_path / "a"),
            "--adapter",
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0
    settings = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    modules = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert (settings["peft_type"], settings["r"], settings["lora_alpha"]) == ("LORA", 4, 8.0)
    assert settings["target_modules"] == modules and settings["base_model_name_or_path"] is None
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(modules) * 2  # A and B, 7 modules, 2 layers
    q_a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert q_a.shape == (4, 64) and q_a.dtype == torch.float32
    with adapters_off(learner.model):
        base = dict(learner.get_weights(dtype=F32).items())
    model = AutoModelForCausalLM.from_config(hf_config(learner.spec), dtype=F32).eval()
    model.load_state_dict(base, strict=True)
    with torch.no_grad():
        before = model(tokens()).logits
        adapted = PeftModel.from_pretrained(model, str(tmp_path / "a")).eval()
        served = adapted(tokens()).logits
    torch.testing.assert_close(served, learner_logits(learner, tokens()), atol=1e-5, rtol=0)
    assert not torch.allclose(before, served, atol=1e-3)  # the adapters made a difference


def test_an_adapter_export_of_a_full_run_is_one_line(tmp_path, capsys):
    full = LocalLearner(tiny_config())
    full.save(str(tmp_path / "full"))
    out = str(tmp_path / "a")
    assert main(["export", "--checkpoint", str(tmp_path / "full"), "--out", out, "--adapter"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {tmp_path / 'full'} is of a run without [model.lora]: it holds no "
        "adapters; allowed: export without --adapter (the whole model)\n"
    )
    assert not (tmp_path / "a").exists()


ADAPTER_PUSH = {
    "the embedded generator": (
        {},
        {},
        "generator = 'hf' takes merged weights; allowed: push = 'merged', or generator = 'vllm'",
    ),
    "a seeded base": (
        {},
        {"generator": "vllm"},
        "the engine loads the frozen base itself from [model] hf_checkpoint, and a base made "
        "from a seed has no directory; allowed: hf_checkpoint, or push = 'merged'",
    ),
    "another engine model": (
        {"hf_checkpoint": "base"},
        {"generator": "vllm", "model_path": "other"},
        "the engine must start from the base the adapters adapt ([model] hf_checkpoint), not "
        "[rollout] model_path 'other'; allowed: model_path unset",
    ),
    "the output head": (
        {"hf_checkpoint": "base", "target_modules": ["wo", "lm_head"]},
        {"generator": "vllm"},
        "vLLM serves LoRA adapters on attention and MLP layers, not on lm_head; allowed: "
        "targets without lm_head, or push = 'merged'",
    ),
    "a rank vLLM cannot serve": (
        {"hf_checkpoint": "base", "rank": 1024},
        {"generator": "vllm"},
        "rank 1024 is above vLLM's largest LoRA rank; allowed: rank <= 512, or push = 'merged'",
    ),
    "vLLM's LoRA arguments": (
        {"hf_checkpoint": "base"},
        {"generator": "vllm", "vllm": {"max_lora_rank": 64}},
        "[rollout.vllm] max_lora_rank is set by [model.lora], not there; allowed: leave it out",
    ),
}


@pytest.mark.parametrize("case", list(ADAPTER_PUSH))
def test_an_adapter_push_vllm_cannot_take_is_one_line(case):
    """Read from the file alone, as the config is loaded (before any check of the machine)."""
    model, rollout, message = ADAPTER_PUSH[case]
    base = {"hf_checkpoint": model["hf_checkpoint"]} if "hf_checkpoint" in model else {}
    lora = {**LORA, "push": "adapter", **{k: v for k, v in model.items() if k not in base}}
    with pytest.raises(ConfigError) as info:
        tiny_config(model={"lora": lora, **base}, rollout=rollout)
    assert str(info.value) == f"tests: [model.lora] push: {message}"


def test_the_lora_recipe_is_a_valid_config_wherever_its_base_is():
    """configs/toy_lora.toml: valid as written (its base, outputs/toy_lora_base/hf, is made by
    scripts/make_toy_lora_base.sh; `check` only warns where it is not there yet)."""
    config = load_config(str(Path(TOY).with_name("toy_lora.toml")))
    assert config.model.lora.target_modules == ["wqkv", "wo", "w1", "w2", "w3", "lm_head"]
    validated = validate(config, 1, on_this_machine=False)
    assert all("hf_checkpoint" in warning for warning in validated.warnings)
