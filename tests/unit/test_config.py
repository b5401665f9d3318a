"""What a user relies on from the config layer: exact one-line errors, overrides, world-size layouts,
and the `python -m titan_learner check` command (exit 2, one `error:` line, never a traceback).

The bulk runs in-process (`load_config`, `check_world_size`, `main([...])`); a handful of real
subprocesses pin the command-line contract. Shipped configs under configs/*.toml must pass `check`
at the world size they state in a comment line `# world_size: N` (see `intended_world_size`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from titan_learner.cli import main
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.config.toml import load_config
from titan_learner.config.validate import check_world_size

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DEBUG = CONFIGS / "debug.toml"
DEBUG_FSDP_TP = CONFIGS / "debug_fsdp_tp.toml"

SECTIONS = (
    "model, parallelism, activation_checkpoint, compile, optimizer, lr_scheduler, learner, "
    "loss, kl, advantage, rollout, tokenizer, data, reward, env, tool, eval, checkpoint, run, "
    "logging"
)
PARALLELISM_KEYS = (
    "dp_replicate, dp_shard, fsdp_reshard_after_forward, param_dtype, reduce_dtype, "
    "sequence_parallel, tp"
)
LLAMA3_FLAVORS = "debugmodel, 1B, 3B, 8B, 70B, 405B"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def exact(message: str) -> str:
    """A regex that matches `message` and nothing else."""
    return re.escape(message)


# One case per thing a user gets wrong: (TOML text, --set overrides, regex for the message after
# "<file>: "). Most are exact strings; the rest pin every word except what another library words.
BAD_CONFIGS = {
    "unknown_section": (
        "[paralelism]\ntp = 2\n",
        [],
        exact(
            "unknown section [paralelism] (did you mean 'parallelism'?); "
            f"allowed sections: {SECTIONS}"
        ),
    ),
    "export_hf_without_saves": (
        "[checkpoint]\nexport_hf = true\n",
        [],
        exact(
            "[checkpoint] export_hf: export_hf = true exports each saved step, and interval = 0 "
            "saves none; allowed: interval >= 1, or export_hf = false"
        ),
    ),
    "env_class_without_a_name": (
        '[env]\nclass = "envs.py"\n',
        [],
        exact(
            "[env] class: 'envs.py' names no class; allowed: 'file.py:Name' or "
            "'package.module:Name'"
        ),
    ),
    "env_unknown_key": (
        "[env]\nmax_turn = 3\n",
        [],
        exact(
            "[env]: unknown key 'max_turn' (did you mean 'max_turns'?); allowed keys: class, "
            "max_total_tokens, max_turns, step_timeout_s, tool_parser, tool_workers"
        ),
    ),
    "env_zero_turns": (
        "[env]\nmax_turns = 0\n",
        [],
        exact("[env] max_turns: 0 is out of range; allowed: >= 1"),
    ),
    "env_unknown_tool_parser": (
        '[env]\ntool_parser = "qwen"\n',
        [],
        exact(
            "[env] tool_parser: 'qwen' is no tool parser; allowed: auto, hermes, llama3, "
            "'file.py:function' or 'package.module:function'"
        ),
    ),
    "tool_without_a_function": (
        '[[tool]]\nfunction = "tools.py:calculator"\n\n[[tool]]\n',
        [],
        exact(
            "[[tool]] #2 function: '' names no function; allowed: 'file.py:function' or "
            "'package.module:function'"
        ),
    ),
    "tool_not_an_array": (
        '[tool]\nfunction = "tools.py:calculator"\n',
        [],
        exact("[tool] must be an array of tables, written [[tool]]"),
    ),
    "section_not_a_table": (
        "parallelism = 2\n",
        [],
        exact("[parallelism] must be a table"),
    ),
    "unknown_key": (
        "[parallelism]\ntpp = 2\n",
        [],
        exact(
            f"[parallelism]: unknown key 'tpp' (did you mean 'tp'?); allowed keys: {PARALLELISM_KEYS}"
        ),
    ),
    "nested_unknown_key": (
        # The location of a nested table is not pinned ("[model] overrides" today, "[model.overrides]"
        # would be clearer); the key, the suggestion and the allowed keys are.
        "[model.overrides]\nn_head = 4\n",
        [],
        r"(\[model\] overrides|\[model\.overrides\]): "
        + exact(
            "unknown key 'n_head' (did you mean 'n_heads'?); allowed keys: dim, head_dim, "
            "hidden_dim, max_seq_len, n_heads, n_kv_heads, n_layers, rope_theta, vocab_size"
        ),
    ),
    "tp_is_a_string": (
        '[parallelism]\ntp = "2"\n',
        [],
        exact("[parallelism] tp: expected an integer, got '2'"),
    ),
    "lr_is_a_word": (
        '[optimizer]\nlr = "fast"\n',
        [],
        exact("[optimizer] lr: expected a number, got 'fast'"),
    ),
    "bool_is_an_int": (
        "[parallelism]\nsequence_parallel = 1\n",
        [],
        exact("[parallelism] sequence_parallel: expected true or false, got 1"),
    ),
    "optional_number_is_a_word": (
        '[learner]\nclip_norm = "off"\n',
        [],
        exact("[learner] clip_norm: expected a number, got 'off'"),
    ),
    "subtable_is_a_scalar": (
        "[model]\noverrides = 3\n",
        [],
        exact("[model] overrides: expected a [model.overrides] table, got 3"),
    ),
    "betas_too_short": (
        "[optimizer]\nbetas = [0.9]\n",
        [],
        # "expected an array of a number, a number" today; "2 numbers" would read better.
        r"\[optimizer\] betas: expected an array of .*, got \[0\.9\]",
    ),
    "tp_zero": (
        "[parallelism]\ntp = 0\n",
        [],
        exact("[parallelism] tp: 0 is out of range; allowed: >= 1"),
    ),
    "lr_negative": (
        "[optimizer]\nlr = -1\n",
        [],
        exact("[optimizer] lr: -1.0 is out of range; allowed: >= 0.0"),
    ),
    "grad_accum_zero": (
        "[learner]\ngrad_accum_steps = 0\n",
        [],
        exact("[learner] grad_accum_steps: 0 is out of range; allowed: >= 1"),
    ),
    "min_lr_factor_above_one": (
        "[lr_scheduler]\nmin_lr_factor = 2\n",
        [],
        exact("[lr_scheduler] min_lr_factor: 2.0 is out of range; allowed: >= 0.0 and <= 1.0"),
    ),
    "dp_shard_below_minus_one": (
        "[parallelism]\ndp_shard = -2\n",
        [],
        exact("[parallelism] dp_shard: -2 is out of range; allowed: >= -1"),
    ),
    "ac_mode_typo": (
        '[activation_checkpoint]\nmode = "ful"\n',
        [],
        exact(
            "[activation_checkpoint] mode: 'ful' is not allowed; "
            "allowed: 'none', 'full', 'selective' (did you mean 'full'?)"
        ),
    ),
    "unknown_model": (
        '[model]\nname = "gpt2"\n',
        [],
        exact("[model] name: 'gpt2' is not allowed; allowed: 'llama3', 'qwen3'"),
    ),
    "unknown_loss": (
        '[loss]\nname = "ppo"\n',
        [],
        exact("[loss] name: 'ppo' is not allowed; allowed: 'grpo', 'dapo', 'cispo', 'gspo'"),
    ),
    "loss_key_typo": (
        "[loss]\nclip_eps = 0.2\n",
        [],
        # The allowed keys are GRPOLoss.__init__'s own (TorchRL's), so only their shape is pinned.
        exact("[loss]: unknown key 'clip_eps' for loss 'grpo' (did you mean 'clip_epsilon'?); ")
        + r"allowed keys: name, (?=.*\bclip_epsilon\b)(?=.*\bentropy_coeff\b)(?!.*actor_network)"
        + r"[a-z_]+(, [a-z_]+)*",
    ),
    "dapo_scalar_clip_epsilon": (
        '[loss]\nname = "dapo"\nclip_epsilon = 0.2\n',
        [],
        exact("[loss] clip_epsilon: dapo takes an asymmetric clip_epsilon = [low, high], got 0.2"),
    ),
    "loss_aggregation_typo": (
        '[loss]\naggregation = "prompt-mean"\n',
        [],
        exact(
            "[loss] aggregation: 'prompt-mean' is not allowed; allowed: 'token_mean', "
            "'prompt_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm' (did you mean "
            "'prompt_mean'?)"
        ),
    ),
    "loss_clip_epsilon_triple": (
        "[loss]\nclip_epsilon = [0.1, 0.2, 0.3]\n",
        [],
        exact(
            "[loss] clip_epsilon: expected a number or an array of 2 numbers, got [0.1, 0.2, 0.3]"
        ),
    ),
    "loss_clip_epsilon_zero_high": (
        '[loss]\nname = "dapo"\nclip_epsilon = [0.2, 0.0]\n',
        [],
        exact(
            "[loss] clip_epsilon: [0.2, 0.0] is out of range; allowed: 0 < clip_epsilon < 1, or "
            "[low, high] with 0 <= low < 1 and high > 0 (finite numbers)"
        ),
    ),
    "loss_mc_samples_zero": (
        "[loss]\nsamples_mc_entropy = 0\n",
        [],
        exact("[loss] samples_mc_entropy: 0 is out of range; allowed: >= 1"),
    ),
    "loss_unread_clip_value": (
        "[loss]\nclip_value = 0.5\n",
        [],
        exact(
            "[loss] clip_value: TorchRL's GRPO-family losses take clip_value but never read it; "
            "allowed: leave it out"
        ),
    ),
    "compile_tp_and_ac": (
        '[parallelism]\ntp = 2\n[compile]\nenable = true\n[activation_checkpoint]\nmode = "full"\n',
        [],
        exact(
            "[compile] enable: compile with tensor parallel and activation checkpointing together "
            "fails in torch 2.13; allowed: any two of them"
        ),
    ),
    "invalid_toml": (
        "[parallelism\ntp = 2\n",
        [],
        # The detail is tomllib's wording; the position is what a user needs.
        r"invalid TOML: .+ \(at line 1, column \d+\)",
    ),
    "lr_nan": (
        "[optimizer]\nlr = nan\n",
        [],
        exact("[optimizer] lr: nan is not a finite number; allowed: a finite number"),
    ),
    "rope_theta_inf": (
        "[model.overrides]\nrope_theta = inf\n",
        [],
        exact("[model.overrides] rope_theta: inf is not a finite number; allowed: a finite number"),
    ),
    "seed_too_large": (
        "[run]\nseed = 100000000000000000000\n",
        [],
        exact("[run] seed: 100000000000000000000 is out of range; allowed: >= 0 and <= 2147483647"),
    ),
    "seed_out_of_range": (
        "[run]\nseed = 4294967296\n",
        [],
        exact("[run] seed: 4294967296 is out of range; allowed: >= 0 and <= 2147483647"),
    ),
    "override_bare_word_is_a_string": (
        "",
        ["parallelism.tp=two"],
        exact("[parallelism] tp: expected an integer, got 'two'"),
    ),
}


# A malformed --set is the command line's fault, not the file's: the message says so.
BAD_OVERRIDES = {
    "tp2": "--set: 'tp2': expected SECTION.KEY=VALUE (a TOML value), e.g. parallelism.tp=2",
    "tp=2": "--set: 'tp=2': expected SECTION.KEY=VALUE (a TOML value), e.g. parallelism.tp=2",
    "model.name.x=1": "--set: 'model.name.x=1': 'name' is not a table",
}


@pytest.mark.parametrize("override", list(BAD_OVERRIDES))
def test_malformed_override_names_the_command_line(tmp_path, capsys, override):
    path = write(tmp_path, '[model]\nname = "llama3"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    assert str(info.value) == BAD_OVERRIDES[override]
    code, out, err = run_check(capsys, "--config", str(path), "--set", override)
    assert (code, out, err) == (2, "", f"error: {BAD_OVERRIDES[override]}\n")


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_load_config_error(tmp_path, case):
    text, overrides, pattern = BAD_CONFIGS[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert re.fullmatch(exact(f"{path}: ") + pattern, str(info.value)), str(info.value)
    assert info.value.source == str(path)


def test_load_config_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: file not found"


def test_load_config_not_utf8(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"[run]\nseed = 1\n\xff\xfe\x00")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: not UTF-8 text (byte 15); allowed: a TOML file"


def test_load_config_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read file: Is a directory"


def test_error_where_is_the_section_and_key(tmp_path):
    path = write(tmp_path, "[parallelism]\ntp = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.where == "[parallelism] tp"
    assert info.value.detail == "0 is out of range; allowed: >= 1"


def test_dp_shard_zero_says_what_is_allowed(tmp_path):
    path = write(tmp_path, "[parallelism]\ndp_shard = 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: [parallelism] dp_shard: 0 ")
    assert "allowed:" in message and "-1" in message


# ---------------------------------------------------------------------------------------- overrides


def test_overrides_set_typed_values(tmp_path):
    path = write(tmp_path, "[parallelism]\ntp = 1\n[optimizer]\nlr = 1e-3\n")
    config = load_config(
        path, ["parallelism.tp=2", "optimizer.betas=[0.8, 0.9]", "model.name=qwen3"]
    )
    assert config.parallelism.tp == 2 and type(config.parallelism.tp) is int
    assert config.optimizer.betas == (0.8, 0.9)
    assert all(type(b) is float for b in config.optimizer.betas)
    assert config.model.name == "qwen3"
    assert config.optimizer.lr == 1e-3  # untouched keys keep the file's value
    assert config.source == str(path)


def test_override_values_parse_as_toml(tmp_path):
    path = write(tmp_path, '[run]\noutput_dir = "outputs/a"\n')
    config = load_config(
        path,
        [
            "run.output_dir=outputs/b",  # not TOML: a bare string
            'model.flavor="8B"',  # quoted TOML string
            "parallelism.sequence_parallel=false",
            "learner.clip_norm=0.5",
            "optimizer.lr=2e-5",
            "model.overrides.n_heads=8",  # nested table
            " loss.clip_epsilon = [0.2, 0.28] ",  # spaces around keys and value
            "loss.name=dapo",
        ],
    )
    assert config.run.output_dir == "outputs/b"
    assert config.model.flavor == "8B"
    assert config.parallelism.sequence_parallel is False
    assert config.learner.clip_norm == 0.5
    assert config.optimizer.lr == 2e-5
    assert config.model.overrides.n_heads == 8
    assert config.loss.name == "dapo"
    assert config.loss.kwargs == {"clip_epsilon": [0.2, 0.28]}


def test_later_override_wins(tmp_path):
    path = write(tmp_path, "")
    config = load_config(path, ["parallelism.tp=2", "parallelism.tp=4"])
    assert config.parallelism.tp == 4


def test_defaults_from_an_empty_file(tmp_path):
    config = load_config(write(tmp_path, ""))
    assert config.parallelism.dp_shard == -1
    assert (config.parallelism.dp_replicate, config.parallelism.tp) == (1, 1)
    assert config.model.name == "llama3" and config.loss.name == "grpo"


# ------------------------------------------------------------------------------------- world size


def layout(tmp_path: Path, **parallelism: int) -> Config:
    lines = "".join(f"{k} = {v}\n" for k, v in parallelism.items())
    return load_config(write(tmp_path, "[parallelism]\n" + lines))


@pytest.mark.parametrize(
    ("dp_replicate", "tp", "world", "resolved"),
    [
        (1, 1, 1, (1, 1, 1)),
        (1, 1, 4, (1, 4, 1)),
        (1, 2, 4, (1, 2, 2)),
        (1, 4, 4, (1, 1, 4)),
        (2, 1, 2, (2, 1, 1)),
        (2, 2, 8, (2, 2, 2)),
    ],
)
def test_dp_shard_minus_one_fills_the_world(tmp_path, dp_replicate, tp, world, resolved):
    config = layout(tmp_path, dp_replicate=dp_replicate, dp_shard=-1, tp=tp)
    assert check_world_size(config, world) == resolved


def test_explicit_layout_matching_the_world(tmp_path):
    config = layout(tmp_path, dp_replicate=2, dp_shard=2, tp=2)
    assert check_world_size(config, 8) == (2, 2, 2)


@pytest.mark.parametrize(
    ("parallelism", "world", "product"),
    [
        ({"dp_shard": 2, "tp": 2}, 2, "1*2*2 = 4"),
        ({"dp_shard": 2, "tp": 2}, 8, "1*2*2 = 4"),
        ({"dp_replicate": 2, "dp_shard": 1}, 1, "2*1*1 = 2"),
    ],
)
def test_layout_product_must_equal_world_size(tmp_path, parallelism, world, product):
    config = layout(tmp_path, **parallelism)
    with pytest.raises(ConfigError) as info:
        check_world_size(config, world)
    assert str(info.value) == (
        f"{config.source}: [parallelism]: dp_replicate*dp_shard*tp = {product} but the world size "
        f"is {world}; allowed: a layout whose product equals the number of processes"
    )


@pytest.mark.parametrize(
    ("parallelism", "world", "divisor"),
    [({"tp": 2}, 3, 2), ({"dp_replicate": 2, "tp": 2}, 6, 4), ({"tp": 4}, 2, 4)],
)
def test_dp_shard_minus_one_needs_a_divisible_world(tmp_path, parallelism, world, divisor):
    config = layout(tmp_path, dp_shard=-1, **parallelism)
    with pytest.raises(ConfigError) as info:
        check_world_size(config, world)
    assert str(info.value) == (
        f"{config.source}: [parallelism] dp_shard: dp_shard=-1 fills the world, but world size "
        f"{world} is not divisible by dp_replicate*tp = {divisor}"
    )


# ------------------------------------------------------------------------ check command, in-process


def run_check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_check_command_prints_one_error_line(tmp_path, capsys, case):
    text, overrides, pattern = BAD_CONFIGS[case]
    path = write(tmp_path, text)
    sets = [arg for item in overrides for arg in ("--set", item)]
    code, out, err = run_check(capsys, "--config", str(path), *sets)
    assert code == 2
    assert out == ""
    assert re.fullmatch(exact(f"error: {path}: ") + pattern + "\n", err), err


def test_check_counts_the_frozen_copies_the_job_holds(capsys):
    """The KL reference and the weights kept for stale steps are parameter copies per rank."""
    from titan_learner.cli.check import plan

    config = load_config(DEBUG)
    assert "frozen" not in plan(config, 1).bytes_per_rank
    both = ["loss.kl_to_ref_coeff=0.01", "rollout.max_off_policy_steps=2"]
    memory = plan(load_config(DEBUG, both), 1).bytes_per_rank
    assert memory["frozen"] == 3 * memory["parameters"]
    off = [*both, "rollout.stale_logprob_mismatch=false"]
    assert plan(load_config(DEBUG, off), 1).bytes_per_rank["frozen"] == memory["parameters"]
    code, out, _ = run_check(capsys, "--config", str(DEBUG), *(f"--set={s}" for s in both))
    assert code == 0 and re.search(r"\n  frozen +[\d.]+ [KMG]iB\n", out), out


def test_check_command_world_size_mismatch(capsys):
    code, out, err = run_check(capsys, "--config", str(DEBUG_FSDP_TP), "--world-size", "2")
    assert (code, out) == (2, "")
    assert err == (
        f"error: {DEBUG_FSDP_TP}: [parallelism]: dp_replicate*dp_shard*tp = 1*2*2 = 4 but the "
        "world size is 2; allowed: a layout whose product equals the number of processes\n"
    )


def test_check_command_world_size_from_environment(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, out, err = run_check(capsys, "--config", str(DEBUG_FSDP_TP))
    assert (code, err) == (0, "")
    assert "world size: 4   mesh: dp_replicate=1 x dp_shard=2 x tp=2" in out


def test_check_command_tp_must_divide_heads(capsys):
    code, out, err = run_check(
        capsys, "--config", str(DEBUG), "--set", "parallelism.tp=3", "--world-size", "3"
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {DEBUG}: [parallelism] tp: ")
    assert "tp = 3 must divide n_heads (4) and n_kv_heads (2); allowed: 1, 2" in err
    assert err.count("\n") == 1


def test_check_command_tp_must_divide_kv_heads(capsys):
    # debug.toml: n_heads=4, n_kv_heads=2; tp=4 divides the heads but not the KV heads.
    code, out, err = run_check(
        capsys, "--config", str(DEBUG), "--set", "parallelism.tp=4", "--world-size", "4"
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {DEBUG}: [parallelism] tp: ")
    assert "n_kv_heads (2)" in err
    assert err.count("\n") == 1


def test_check_command_unknown_flavor_names_the_file(capsys):
    code, out, err = run_check(capsys, "--config", str(DEBUG), "--set", "model.flavor=9B")
    assert (code, out) == (2, "")
    assert err == (
        f"error: {DEBUG}: [model] flavor: unknown llama3 flavor '9B'; allowed: {LLAMA3_FLAVORS}\n"
    )


def test_check_command_unknown_flavor_is_one_error_line(capsys):
    code, out, err = run_check(capsys, "--config", str(DEBUG), "--set", "model.flavor=9B")
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and err.count("\n") == 1
    assert err.endswith(f"[model] flavor: unknown llama3 flavor '9B'; allowed: {LLAMA3_FLAVORS}\n")


def test_check_command_bad_model_shape_is_a_config_error(capsys):
    code, out, err = run_check(
        capsys, "--config", str(DEBUG), "--set", "model.overrides.n_kv_heads=3"
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {DEBUG}: [model") and err.count("\n") == 1
    assert "n_kv_heads" in err


def test_check_command_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.toml"
    code, out, err = run_check(capsys, "--config", str(path))
    assert (code, out, err) == (2, "", f"error: {path}: file not found\n")


def test_check_command_prints_the_plan(tmp_path, capsys):
    code, out, err = run_check(capsys, "--config", str(DEBUG), "--world-size", "2")
    assert (code, err) == (0, "")
    assert out.startswith(f"config: {DEBUG} (valid)\n")
    assert "world size: 2   mesh: dp_replicate=1 x dp_shard=2 x tp=1" in out
    # The resolved config it prints is TOML that loads back to the same config.
    resolved = out.split("[resolved]\n", 1)[1].split("\n\nworld size:", 1)[0]
    reloaded = load_config(write(tmp_path, resolved))
    original = load_config(DEBUG)
    reloaded.source = original.source
    assert reloaded == original


# -------------------------------------------------------------------- check command, as a process


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run(
        [sys.executable, "-m", "titan_learner", "check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_valid_config():
    result = cli("--config", "configs/debug_fsdp_tp.toml", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "mesh: dp_replicate=1 x dp_shard=2 x tp=2" in result.stdout
    assert "\nparameters: " in result.stdout


# (args, regex for the whole stderr line after "error: "); <FILE> stands for the config given.
CLI_ERRORS = {
    # Fail while loading, before torch is imported: cheap.
    "unknown_section": (
        ["--set", "paralelism.tp=2"],
        exact("<FILE>: unknown section [paralelism] (did you mean 'parallelism'?); ")
        + r"allowed sections: .*",
    ),
    "wrong_type": (
        ["--set", 'parallelism.tp="2"'],
        exact("<FILE>: [parallelism] tp: expected an integer, got '2'"),
    ),
    "out_of_range": (
        ["--set", "learner.grad_accum_steps=0"],
        exact("<FILE>: [learner] grad_accum_steps: 0 is out of range; allowed: >= 1"),
    ),
    "not_allowed": (
        ["--set", "activation_checkpoint.mode=ful"],
        exact("<FILE>: [activation_checkpoint] mode: 'ful' is not allowed; ")
        + r"allowed: .*\(did you mean 'full'\?\)",
    ),
    "bad_override": (
        ["--set", "tp2"],
        exact("--set: 'tp2': expected SECTION.KEY=VALUE (a TOML value), e.g. parallelism.tp=2"),
    ),
    "missing_file": (
        ["--config", "configs/no_such.toml"],
        exact("configs/no_such.toml: file not found"),
    ),
    # Fail after torch is imported (model build): ~5 s each.
    "tp_does_not_divide_heads": (
        ["--set", "parallelism.tp=3", "--world-size", "3"],
        exact("<FILE>: [parallelism] tp: tp = 3 must divide n_heads (4) and n_kv_heads (2); ")
        + exact("allowed: 1, 2"),
    ),
    "unknown_flavor": (
        ["--set", "model.flavor=9B"],
        # The file is not pinned here: see test_check_command_unknown_flavor_names_the_file.
        r".*\[model\] flavor: unknown llama3 flavor '9B'; allowed: .*",
    ),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_error_is_one_line_and_exit_2(case):
    args, pattern = CLI_ERRORS[case]
    config = "configs/debug.toml"
    if "--config" in args:
        config = args[args.index("--config") + 1]
    else:
        args = ["--config", config, *args]
    result = cli(*args)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == 2, output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    expected = pattern.replace("<FILE>", re.escape(config))
    assert re.fullmatch(expected, lines[0][len("error: ") :]), lines[0]


# --------------------------------------------------------------------------------- shipped configs

WORLD_SIZE_COMMENT = re.compile(r"^#\s*world_size:\s*(\d+)\s*$", re.MULTILINE)


def intended_world_size(path: Path) -> int:
    """The world size a shipped config is meant for.

    Convention: a comment line `# world_size: N` in the file. Without it, a fully explicit layout
    (dp_shard != -1) means its own product dp_replicate*dp_shard*tp, and anything else means 1.
    """
    text = path.read_text()
    found = WORLD_SIZE_COMMENT.search(text)
    if found:
        return int(found.group(1))
    try:
        parallelism = tomllib.loads(text).get("parallelism", {})
    except tomllib.TOMLDecodeError:
        return 1  # `check` reports the syntax error itself
    dp_shard = parallelism.get("dp_shard", -1)
    if dp_shard == -1:
        return 1
    return parallelism.get("dp_replicate", 1) * dp_shard * parallelism.get("tp", 1)


SHIPPED = sorted(CONFIGS.glob("*.toml"))


def test_debug_configs_are_shipped():
    assert DEBUG in SHIPPED and DEBUG_FSDP_TP in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_passes_check(capsys, path):
    world = intended_world_size(path)
    code, out, err = run_check(capsys, "--config", str(path), "--world-size", str(world))
    assert (code, err) == (0, ""), err
    assert f"world size: {world}   mesh: " in out
    assert_parameter_count_reads(out)


def assert_parameter_count_reads(out: str) -> None:
    """The count is given in full and as people say it, B from a billion and M below: a toy's
    0.13 M, never 0.00 B."""
    count, value, unit = re.search(r"\nparameters: ([\d,]+) \((\d+\.\d\d) ([MB])\)\n", out).groups()
    count = int(count.replace(",", ""))
    assert unit == ("B" if count >= 10**9 else "M")
    assert float(value) == round(count / (1e9 if unit == "B" else 1e6), 2) > 0


def test_world_size_comment_convention(tmp_path):
    assert intended_world_size(write(tmp_path, "# world_size: 8\n[model]\n", "a.toml")) == 8
    assert intended_world_size(write(tmp_path, "[parallelism]\ndp_shard = -1\n", "b.toml")) == 1
    assert intended_world_size(write(tmp_path, "[parallelism]\ndp_shard=2\ntp=2\n", "c.toml")) == 4
    assert intended_world_size(DEBUG_FSDP_TP) == 4
