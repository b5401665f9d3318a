"""`python -m titan_learner export`: a checkpoint becomes a Hugging Face directory that transformers
loads with the learner's logits; bad input ends in one `error:` line and exit 2.

Also the resolved config a checkpoint carries (`config_to_toml`, `save_resolved_config`): what
`export` reads to know which model it holds, so it must load back to the very same config.

Everything runs in this process (`main([...])`) on tiny CPU models, except one subprocess that
pins the command-line contract (exit code, no traceback).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.hf_dirs import CHAT_TEMPLATE, eos_ids, make_model_dir, make_tokenizer
from tests.support.models import VOCAB, batches, tiny_config
from titan_learner.checkpoint.hf_export import ExportError, export_checkpoint
from titan_learner.checkpoint.layout import save_resolved_config
from titan_learner.cli import main
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import (
    config_from_dict,
    config_to_toml,
    load_config,
    resolved_config_text,
)
from titan_learner.dtypes import DTYPE_NAMES, parse_dtype
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.toml"))
F32, BF16 = torch.float32, torch.bfloat16
BF16_ATOL = 3e-2  # bf16 keeps 8 bits of mantissa: logits of O(1) move by ~1e-2


@dataclasses.dataclass
class Run:
    """A checkpoint root holding step-1 and step-2 of a trained LocalLearner, and its logits."""

    name: str
    root: Path
    learner: LocalLearner
    tokens: torch.Tensor
    logits: dict[int, torch.Tensor]


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out).float()


_RUNS: dict[str, Run] = {}


def _trained(name: str, factory: pytest.TempPathFactory) -> Run:
    if name not in _RUNS:
        root = factory.mktemp(f"checkpoints-{name}")
        config = tiny_config(name)
        learner = LocalLearner(config)
        tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))
        logits = {}
        for batch in batches(2):
            learner.update(batch)
            learner.save(str(root)).wait()
            logits[learner.step] = _logits(learner.model, tokens)
        save_resolved_config(config, root)
        _RUNS[name] = Run(name, root, learner, tokens, logits)
    return _RUNS[name]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def run(request, tmp_path_factory) -> Run:
    return _trained(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Run:
    return _trained("llama3", tmp_path_factory)


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def load_hf(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=F32).eval()


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def assert_one_error(code: int, out: str, err: str, *parts: str) -> None:
    assert (code, out) == (2, ""), err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in err, (part, err)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".tmp"))


# -- exports that work ---------------------------------------------------------------------------


def test_fp32_export_loads_in_transformers_with_the_learners_logits(run, tmp_path, capsys):
    out = tmp_path / "hf"
    code, stdout, err = export(capsys, "--checkpoint", run.root, "--out", out, "--dtype", "fp32")
    assert (code, err) == (0, ""), err
    assert stdout == f"exported {run.root} to {out}\n"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    arch = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[run.name]
    assert config["architectures"] == [arch] and config["dtype"] == "float32"
    # The file holds exactly the learner's HF-named weights, bit for bit (a tied lm_head once).
    expected = dict(run.learner.get_weights(dtype=F32).items())
    saved = saved_tensors(out)
    assert set(saved) <= set(expected) and len(saved) >= len(expected) - 1
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    torch.testing.assert_close(_logits(load_hf(out), run.tokens), run.logits[2], atol=1e-5, rtol=0)
    assert leftovers(tmp_path) == []


def test_bf16_export_holds_bf16_tensors_and_close_logits(run, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(capsys, "--checkpoint", run.root, "--out", out, "--dtype", "bf16")
    assert (code, err) == (0, ""), err
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    expected = dict(run.learner.get_weights(dtype=BF16).items())
    for name, tensor in saved_tensors(out).items():
        assert tensor.dtype == BF16 and torch.equal(tensor, expected[name]), name
    logits = _logits(load_hf(out), run.tokens)
    torch.testing.assert_close(logits, run.logits[2], atol=BF16_ATOL, rtol=0)


def test_default_dtype_is_the_configs_export_dtype(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(capsys, "--checkpoint", llama.root, "--out", out)
    assert (code, err) == (0, ""), err
    assert load_config(llama.root / "config.toml").learner.export_dtype == "bfloat16"
    assert {t.dtype for t in saved_tensors(out).values()} == {BF16}


def test_no_made_up_token_ids_without_a_base_model(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export(capsys, "--checkpoint", llama.root, "--out", out)[0] == 0
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id"):  # LlamaConfig's defaults would say 1 and 2
        assert config.get(key) is None and generation.get(key) is None, key


def test_the_base_models_tokenizer_generation_config_and_fields_go_along(llama, tmp_path, capsys):
    """[model] hf_checkpoint names the model the run started from: its tokenizer (with its chat
    template), generation defaults, special token ids and config.json fields describe the
    export too; the EOS ids are every one the run stopped on."""
    base = tmp_path / "base"
    hf_cfg = hf_config(llama.learner.spec)
    hf_cfg.bos_token_id, hf_cfg.eos_token_id = 5, [6, 7]
    AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(base)
    capsys.readouterr()  # its progress bar
    tokenizer = make_tokenizer(base)
    base_fields = json.loads((base / "config.json").read_text())
    base_fields |= {"torch_dtype": "bfloat16", "max_window_layers": 2, "custom_field": "kept"}
    (base / "config.json").write_text(json.dumps(base_fields))
    generation = {"eos_token_id": [6, 7], "temperature": 0.6, "do_sample": True}
    (base / "generation_config.json").write_text(json.dumps(generation))
    config = tiny_config("llama3", model={"hf_checkpoint": str(base)})
    save_resolved_config(config, tmp_path)
    out = tmp_path / "hf"
    code, _, err = export(
        capsys, "--checkpoint", llama.root, "--out", out, "--dtype", "fp32",
        "--config", tmp_path / "config.toml",
    )  # fmt: skip
    assert (code, err) == (0, ""), err
    served = AutoTokenizer.from_pretrained(out)
    assert served.chat_template == CHAT_TEMPLATE
    assert served("What is 2 + 3?")["input_ids"] == tokenizer("What is 2 + 3?")["input_ids"]
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<pad>"])
    assert json.loads((out / "generation_config.json").read_text()) == generation | {
        "eos_token_id": [im_end, 6, 7],
        "pad_token_id": pad,
    }
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (5, [6, 7])
    assert (exported["custom_field"], exported["max_window_layers"]) == ("kept", 2)
    assert exported["architectures"] == ["LlamaForCausalLM"]
    assert exported["torch_dtype"] == exported["dtype"] == "float32"
    # The weights are the checkpoint's, not the base model's.
    torch.testing.assert_close(
        _logits(load_hf(out), llama.tokens), llama.logits[2], atol=1e-5, rtol=0
    )


def test_large_exports_are_sharded_with_an_index(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(
        capsys, "--checkpoint", llama.root, "--out", out, "--dtype", "fp32",
        "--max-shard-size", "40000",
    )  # fmt: skip
    assert (code, err) == (0, ""), err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    torch.testing.assert_close(
        _logits(load_hf(out), llama.tokens), llama.logits[2], atol=1e-5, rtol=0
    )


def test_bad_max_shard_size(llama, tmp_path, capsys):
    assert_one_error(
        *export(
            capsys,
            "--checkpoint",
            llama.root,
            "--out",
            tmp_path / "hf",
            "--max-shard-size",
            "lots",
        ),
        "error: --max-shard-size: 'lots' is not a size; allowed: a number of bytes, or a "
        "number with KB, MB, GB (or KiB, MiB, GiB), e.g. 500MB\n",
    )
    assert not (tmp_path / "hf").exists()


def test_step_selects_an_older_checkpoint(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(
        capsys, "--checkpoint", llama.root, "--out", out, "--dtype", "float32", "--step", "1"
    )
    assert (code, err) == (0, ""), err
    logits = _logits(load_hf(out), llama.tokens)
    torch.testing.assert_close(logits, llama.logits[1], atol=1e-5, rtol=0)
    assert not torch.allclose(logits, llama.logits[2], atol=1e-3), "step 1, not the latest"


def test_a_step_directory_finds_the_config_of_its_root(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(
        capsys, "--checkpoint", llama.root / "step-2", "--out", out, "--dtype", "fp32"
    )
    assert (code, err) == (0, ""), err
    torch.testing.assert_close(
        _logits(load_hf(out), llama.tokens), llama.logits[2], atol=1e-5, rtol=0
    )


def test_a_step_directory_without_configs_names_both_places(llama, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(llama.root, root)
    (root / "config.toml").unlink()
    assert_one_error(
        *export(capsys, "--checkpoint", root / "step-2", "--out", tmp_path / "hf"),
        f"{root / 'step-2' / 'config.toml'} or {root / 'config.toml'} not found",
    )


def test_config_flag_replaces_a_missing_config_toml(llama, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(llama.root, root)
    (root / "config.toml").rename(tmp_path / "run.toml")
    out = tmp_path / "hf"
    code, _, err = export(
        capsys,
        "--checkpoint",
        root,
        "--out",
        out,
        "--dtype",
        "fp32",
        "--config",
        tmp_path / "run.toml",
    )
    assert (code, err) == (0, ""), err
    torch.testing.assert_close(
        _logits(load_hf(out), llama.tokens), llama.logits[2], atol=1e-5, rtol=0
    )


def test_library_call_into_an_empty_directory_keeps_the_callers_rng(llama, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is a fine target
    rng = torch.get_rng_state()
    assert export_checkpoint(llama.root, out, torch.float32) == out
    assert torch.equal(torch.get_rng_state(), rng)
    torch.testing.assert_close(
        _logits(load_hf(out), llama.tokens), llama.logits[2], atol=1e-5, rtol=0
    )


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Run:
    """A run from a Qwen3 model directory, its [model] without flavor or overrides (the README's
    path): the directory alone decides the shape."""
    base = tmp_path_factory.mktemp("hf-run") / "Qwen3-tiny"
    make_model_dir(base, "qwen3")
    config = config_from_dict(
        {
            "model": {"name": "qwen3", "hf_checkpoint": str(base)},
            "optimizer": {"lr": 1e-3},
            "run": {"seed": 0, "steps": 4},
        }
    )
    root = base.parent / "checkpoints"
    learner = LocalLearner(config)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))
    for batch in batches(2, varied=True):
        learner.update(batch)
    learner.save(str(root)).wait()
    # The run's length changed since (a shorter run resumed, or the file edited): an export
    # restores no LR schedule, so it does not care.
    save_resolved_config(
        dataclasses.replace(config, run=dataclasses.replace(config.run, steps=1)), root
    )
    return Run("qwen3", root, learner, tokens, {2: _logits(learner.model, tokens)})


def test_an_hf_checkpoint_run_exports_the_learners_model(hf_run, tmp_path, capsys):
    out = tmp_path / "hf"
    code, _, err = export(capsys, "--checkpoint", hf_run.root, "--out", out, "--dtype", "fp32")
    assert (code, err) == (0, ""), err
    exported = json.loads((out / "config.json").read_text())
    assert (exported["hidden_size"], exported["num_hidden_layers"], exported["head_dim"]) == (
        64, 2, 16,
    )  # fmt: skip
    assert exported["architectures"] == ["Qwen3ForCausalLM"]
    base = Path(load_config(hf_run.root / "config.toml").model.hf_checkpoint)
    own = AutoTokenizer.from_pretrained(base)
    served = AutoTokenizer.from_pretrained(out)  # no other directory needed
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert served.apply_chat_template(chat, add_generation_prompt=True) == (
        own.apply_chat_template(chat, add_generation_prompt=True)
    )
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos_ids(own)  # both EOS ids the rollouts stopped on
    torch.testing.assert_close(
        _logits(load_hf(out), hf_run.tokens), hf_run.logits[2], atol=1e-5, rtol=0
    )


def test_the_runs_own_template_file_is_the_exports_chat_template(hf_run, tmp_path, capsys):
    """[tokenizer] chat_template = "file.jinja": the export frames chats as the run did, not as
    the tokenizer's own template would."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "mine.jinja").write_text(template)
    config = load_config(hf_run.root / "config.toml")
    config.tokenizer.chat_template = "mine.jinja"  # relative to the config file, as a user writes
    (tmp_path / "run.toml").write_text(config_to_toml(config))
    out = tmp_path / "hf"
    code, _, err = export(
        capsys, "--checkpoint", hf_run.root, "--out", out, "--config", tmp_path / "run.toml"
    )
    assert (code, err) == (0, ""), err
    assert AutoTokenizer.from_pretrained(out).chat_template == template


def test_an_hf_checkpoint_run_exports_after_its_model_directory_moved(hf_run, tmp_path, capsys):
    """The architecture recorded beside the checkpoints replaces the gone config.json."""
    root = tmp_path / "checkpoints"
    shutil.copytree(hf_run.root, root)
    config = load_config(root / "config.toml")
    moved = tmp_path / "moved"
    shutil.copytree(config.model.hf_checkpoint, moved)
    shutil.rmtree(config.model.hf_checkpoint)
    try:
        out = tmp_path / "hf"
        code, _, err = export(capsys, "--checkpoint", root, "--out", out, "--dtype", "fp32")
        assert (code, err) == (0, ""), err
        torch.testing.assert_close(
            _logits(load_hf(out), hf_run.tokens), hf_run.logits[2], atol=1e-5, rtol=0
        )
        capsys.readouterr()  # transformers' progress bar
        (root / "model_config.json").unlink()  # a checkpoint that recorded nothing
        assert_one_error(
            *export(capsys, "--checkpoint", root, "--out", tmp_path / "hf2"),
            f"error: the run's model directory {config.model.hf_checkpoint} ([model] "
            f"hf_checkpoint) has no config.json here and {root / 'model_config.json'} is missing",
        )
        assert not (tmp_path / "hf2").exists()
    finally:
        shutil.copytree(moved, config.model.hf_checkpoint)


def test_dtype_names():
    for name, dtype in DTYPE_NAMES.items():
        assert parse_dtype(name) is dtype and parse_dtype(name.upper()) is dtype
        assert parse_dtype(dtype) is dtype
    assert set(DTYPE_NAMES.values()) == {torch.bfloat16, torch.float16, torch.float32}
    for bad in ("int8", "fp8", torch.int64):
        with pytest.raises(ConfigError, match="allowed: bf16, bfloat16, fp16, float16, fp32"):
            parse_dtype(bad)


# -- bad input: one line, exit 2, nothing written --------------------------------------------------


def test_missing_config_toml_without_config_flag(llama, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(llama.root, root)
    (root / "config.toml").unlink()
    out = tmp_path / "hf"
    assert_one_error(
        *export(capsys, "--checkpoint", root, "--out", out),
        f"error: no config for checkpoint {root}: {root / 'config.toml'} not found",
        "pass --config FILE",
    )
    assert not out.exists()


def test_missing_checkpoint(tmp_path, capsys):
    out = tmp_path / "hf"
    missing = tmp_path / "nope"
    assert_one_error(
        *export(capsys, "--checkpoint", missing, "--out", out),
        f"error: checkpoint directory {missing} not found\n",
    )
    (tmp_path / "empty").mkdir()
    assert_one_error(
        *export(capsys, "--checkpoint", tmp_path / "empty", "--out", out),
        f"no checkpoint in {tmp_path / 'empty'}",
    )
    assert not out.exists()


def test_a_run_that_saved_nothing_says_why_its_checkpoints_are_missing(tmp_path, capsys):
    """The README's run without [checkpoint] interval: metrics.jsonl but no checkpoints/."""
    run_dir = tmp_path / "outputs" / "my_grpo"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "training/reward_mean": 0.5}\n')
    assert_one_error(
        *export(capsys, "--checkpoint", run_dir / "checkpoints", "--out", tmp_path / "hf"),
        f"error: checkpoint directory {run_dir / 'checkpoints'} not found: the run in {run_dir} "
        "saved no checkpoint ([checkpoint] interval = 0, the default, saves none); allowed: "
        "train with [checkpoint] interval = N (every N steps) and export its checkpoints/\n",
    )
    assert not (tmp_path / "hf").exists()


def test_missing_step(llama, tmp_path, capsys):
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", tmp_path / "hf", "--step", "7"),
        "no checkpoint of step 7",
        "committed steps: [1, 2]",
    )


def test_corrupt_checkpoint(llama, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(llama.root, root)
    for shard in (root / "step-2").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "hf"
    assert_one_error(*export(capsys, "--checkpoint", root, "--out", out), "step-2")
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_config_of_another_model_is_refused(llama, tmp_path, capsys):
    other = tmp_path / "other.toml"
    config = tiny_config("llama3")
    config.model.overrides.dim = 32  # the run's model but narrower
    other.write_text(config_to_toml(config))
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", tmp_path / "hf", "--config", other),
        f"error: checkpoint {llama.root / 'step-2'} does not fit this model",
        "mismatched: tok_embeddings.weight (shape (32, 64) saved, (32, 32) here)",
    )


def test_bad_dtype(llama, tmp_path, capsys):
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", tmp_path / "hf", "--dtype", "int8"),
        "error: --dtype: 'int8' is not an export dtype; allowed: bf16, bfloat16, fp16, float16, "
        "fp32, float32\n",
    )


def test_non_empty_out_dir_is_left_alone(llama, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", out),
        f"output directory {out} is not empty; refusing to overwrite it",
    )
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (tmp_path / "file").write_text("")
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", tmp_path / "file"),
        "is not a directory",
    )


def test_a_write_that_fails_midway_leaves_nothing(llama, tmp_path, capsys, monkeypatch):
    import titan_learner.checkpoint.hf_export as export_module

    def half_written(spec, weights, dtype, directory, *rest):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "_write_hf", half_written)
    out = tmp_path / "hf"
    assert_one_error(
        *export(capsys, "--checkpoint", llama.root, "--out", out), "No space left on device"
    )
    assert not out.exists() and leftovers(tmp_path) == []


def test_command_line_exit_code_and_no_traceback(llama, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(llama.root, root)
    for shard in (root / "step-2").glob("*.distcp"):
        shard.write_bytes(b"\0" * 64)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, "-m", "titan_learner", "export", "--checkpoint", str(root), "--out",
         str(tmp_path / "hf")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "hf").exists()


def test_export_is_missing_required_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--out", "x"])
    assert exit_info.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_export_error_type():
    assert issubclass(ExportError, RuntimeError)


# -- the resolved config a checkpoint carries ----------------------------------------------------


def reloaded(tmp_path: Path, text: str):
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_config_to_toml_round_trips_the_shipped_configs(tmp_path, path):
    config = load_config(path)
    again = reloaded(tmp_path, config_to_toml(config))
    again.source = config.source
    assert again == config


def test_config_to_toml_round_trips_awkward_values(tmp_path):
    config = config_from_dict(
        {
            "model": {"name": "qwen3", "hf_checkpoint": 'dir "quoted"\\back\tslash\u00e9\x7f'},
            "optimizer": {"lr": 3e-7, "betas": [0.5, 0.999]},
            "learner": {"clip_norm": 0.0},
            "loss": {"name": "grpo", "clip_epsilon": [0.2, 0.28], "entropy_coeff": 1e-3},
            "run": {"output_dir": "out/ünï code", "seed": 2**31 - 1},  # the largest seed
        }
    )
    text = config_to_toml(config)
    assert tomllib.loads(text)  # plain TOML
    again = reloaded(tmp_path, text)
    again.source = config.source
    assert again == config


def test_config_to_toml_refuses_a_none_that_toml_cannot_say():
    config = tiny_config()
    config.optimizer.lr = None  # set from Python; left out it would read back as the default
    with pytest.raises(ValueError, match=r"\[optimizer\] lr = None has no TOML form"):
        config_to_toml(config)


def test_resolved_config_leaves_absent_optional_sub_tables_out(tmp_path):
    judge = {"base_url": "http://127.0.0.1:8000/v1", "model": "j", "prompt": "j.jinja"}
    config = config_from_dict(
        {"reward": [{"function": "math"}, {"judge": {**judge, "parse": "(\\d+)"}}]},
        source=str(tmp_path / "run.toml"),
    )
    text = resolved_config_text(config)
    assert "[rollout.vllm]" not in text  # empty, as its default
    assert text.count("[reward.judge]") == 1  # the judge's own, not one under math
    assert "judge" not in tomllib.loads(text)["reward"][0]
    again = reloaded(tmp_path, text)
    again.source = config.source
    assert again == config


def test_check_prints_config_to_toml(capsys):
    path = REPO / "configs" / "debug.toml"
    assert main(["check", "--config", str(path)]) == 0
    assert (
        f"[resolved]\n{config_to_toml(load_config(path))}\n\nworld size:" in capsys.readouterr().out
    )


def test_save_resolved_config_is_atomic_and_loads_back(tmp_path):
    config = load_config(REPO / "configs" / "toy_grpo.toml")
    target = tmp_path / "root"
    assert save_resolved_config(config, target) == target / "config.toml"
    (target / "config.toml").write_text("stale")
    save_resolved_config(config, target)  # replaces the previous file
    assert sorted(p.name for p in target.iterdir()) == ["config.toml"]
    again = load_config(target / "config.toml")
    again.source = config.source
    assert again == config


LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
"""Llama 3.1's scaling with a short original context, so most of the tiny model's frequencies
are scaled and a model without it gives other logits even on a 12-token row."""


def test_an_hf_checkpoint_with_llama3_rope_scaling_exports_it_and_its_logits(tmp_path, capsys):
    """config.json's rope_scaling (Llama 3.1's form) is the learner's RoPE (TorchTitan's
    `scaling = "llama"`), so the export claims it and serves the learner's logits; the same
    weights without the scaling would not."""
    base = tmp_path / "Llama-rope-scaled"
    make_model_dir(base, "llama3")
    fields = json.loads((base / "config.json").read_text())
    fields.pop("rope_parameters", None)
    fields |= {"rope_scaling": LLAMA3_ROPE_SCALING, "rope_theta": 10000.0}
    (base / "config.json").write_text(json.dumps(fields))
    config = config_from_dict(
        {"model": {"name": "llama3", "hf_checkpoint": str(base)}, "run": {"seed": 0}}
    )
    learner = LocalLearner(config)
    rope = learner.spec.model.layers[0].attention.rope
    assert (rope.scaling, rope.scaling_factor, rope.original_max_position_embeddings) == (
        "llama", 8.0, 16,
    )  # fmt: skip
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))
    learned = _logits(learner.model, tokens)
    torch.testing.assert_close(_logits(load_hf(base), tokens), learned, atol=1e-5, rtol=0)
    root = tmp_path / "checkpoints"
    learner.save(str(root)).wait()
    save_resolved_config(config, root)
    capsys.readouterr()  # transformers' progress bars
    out = tmp_path / "hf"
    code, _, err = export(capsys, "--checkpoint", root, "--out", out, "--dtype", "fp32")
    assert (code, err) == (0, ""), err
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_scaling"] == LLAMA3_ROPE_SCALING
    assert exported["rope_parameters"] == LLAMA3_ROPE_SCALING | {"rope_theta": 10000.0}
    served = load_hf(out)
    assert served.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(_logits(served, tokens), learned, atol=1e-5, rtol=0)
    unscaled = dict(exported, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    del unscaled["rope_scaling"]
    (out / "config.json").write_text(json.dumps(unscaled))
    assert (_logits(load_hf(out), tokens) - learned).abs().max() > 1e-3
