"""`titan-learner serve` for servers on GPUs, checked where no GPU is: the command uses every GPU
`--gpus` names, parses under vLLM's own `vllm serve` parser into the engine the job needs, and
`--dry-run` prints a line that a shell runs as it is (the variables included). Servers that run
are in tests/integration/test_rollout_servers.py (CPU)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.servers import run_serve
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.vllm.auth import MIDDLEWARE, TOKEN_ENV
from titan_learner.vllm.serve import parse_gpus, server_command

SERVERS_TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo_servers.toml"
SERVER_MODULE = "-m vllm.entrypoints.launchers.api_server.entry"
PROBE = (
    '-c \'import json, os, sys; print(json.dumps({"env": {k: os.environ.get(k) for k in '
    '("VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES", "TITAN_LEARNER_SERVER_TOKEN")}, '
    '"argv": sys.argv[1:]}))\''
)
"""Stands in for vLLM's server module in a dry run's line: prints what the server would get."""


def gpu_command(*sets: str, gpus: list[str] | None) -> tuple[list[str], dict[str, str]]:
    config = load_config(str(SERVERS_TOY), overrides=list(sets))
    return server_command(config, host="0.0.0.0", port=8000, on_gpu=True, python="py", gpus=gpus)


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")


@pytest.mark.parametrize(
    ("sets", "gpus", "sizes"),
    [
        ((), ["4", "5", "6", "7"], [("--tensor-parallel-size", "4")]),
        ((), ["3"], []),
        (
            ("rollout.vllm.tensor_parallel_size=2", "rollout.vllm.data_parallel_size=2"),
            ["4", "5", "6", "7"],
            [("--tensor-parallel-size", "2"), ("--data-parallel-size", "2")],
        ),
    ],
    ids=["tp-over-all", "one-gpu", "sizes-given"],
)
def test_a_server_uses_every_gpu_it_is_given(token, sets, gpus, sizes):
    argv, env = gpu_command(*sets, gpus=gpus)
    assert [
        pair for pair in itertools.pairwise(argv) if pair[0].endswith("-parallel-size")
    ] == sizes
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(gpus)


def test_parallel_sizes_that_leave_gpus_idle_are_one_line(token):
    with pytest.raises(ConfigError) as info:
        gpu_command("rollout.vllm.tensor_parallel_size=2", gpus=["4", "5", "6", "7"])
    assert str(info.value) == (
        f"{SERVERS_TOY}: --gpus 4,5,6,7 gives the server 4 GPUs and [rollout.vllm] "
        "tensor_parallel_size 2 uses 2; allowed: --gpus naming 2 GPUs, or leave the parallel "
        "sizes out (the server then runs tensor-parallel over every GPU --gpus names)"
    )
    with pytest.raises(ConfigError) as info:
        gpu_command("rollout.vllm.tensor_parallel_size=0", gpus=["4"])
    assert str(info.value).endswith(
        "[rollout.vllm] tensor_parallel_size: 0; allowed: a positive integer"
    )


@pytest.mark.parametrize("text", ["4,,5", "1,1", ""])
def test_bad_gpu_lists_are_one_line(text):
    with pytest.raises(ValueError) as info:
        parse_gpus(text)
    assert str(info.value) == (
        f"--gpus {text!r}: allowed: the server's CUDA devices, comma-separated, each once "
        "(e.g. 4,5,6,7)"
    )
    assert parse_gpus(" 4, GPU-5a1c ") == ["4", "GPU-5a1c"]


def test_a_bad_gpu_list_stops_serve_before_anything_starts():
    done = run_serve(SERVERS_TOY, "--gpus", "4,4")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: --gpus '4,4': allowed: the server's CUDA devices, comma-separated, each once "
        "(e.g. 4,5,6,7)\n"
    )


def test_the_gpu_command_parses_into_the_engine_the_job_needs(token):
    """The flags no CPU server takes (on GPUs: the checked NCCL backend, tensor parallelism)
    go through vLLM 0.32's own `vllm serve` parser and engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv, _ = gpu_command("rollout.vllm.max_num_seqs=64", gpus=["4", "5"])
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    assert (args.host, args.port, args.enable_scale_out, args.middleware) == (
        "0.0.0.0",
        8000,
        True,
        [MIDDLEWARE],
    )
    assert engine.weight_transfer_config.backend == "nccl_checked"
    assert (engine.tensor_parallel_size, engine.max_num_seqs, engine.max_model_len) == (2, 64, 24)
    assert (engine.dtype, engine.seed, engine.logprobs_mode) == ("float32", 0, "raw_logprobs")
    assert engine.skip_tokenizer_init


@pytest.mark.parametrize("source", ["environment", "token_file", "token_file_beside_empty"])
def test_dry_run_prints_a_line_a_shell_runs_as_it_is(tmp_path, source):
    """What the line starts, run by a shell with the server module swapped for a probe: the
    variables the server needs (vLLM's RL routes, the GPUs, the token: read where the line
    runs, never printed) and the flags. An empty variable is no token: the file gives it, as
    it does to a server started without --dry-run."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    sets: list[str] = ["--gpus", "4,5"]
    if source == "environment":
        env[TOKEN_ENV] = "s3cret"
    else:
        if source == "token_file_beside_empty":
            env[TOKEN_ENV] = ""
        (tmp_path / "token").write_text("s3cret\n")
        sets += ["--set", f'rollout.vllm.token_file="{tmp_path / "token"}"']
    done = run_serve(SERVERS_TOY, *sets, "--port", "8123", "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "s3cret" not in line and line.count(SERVER_MODULE) == 1
    probed = subprocess.run(
        ["bash", "-c", line.replace(SERVER_MODULE, PROBE)],
        capture_output=True,
        text=True,
        env={**env, TOKEN_ENV: "s3cret"} if source == "environment" else env,
        check=True,
    )
    started = json.loads(probed.stdout)
    assert started["env"] == {
        "VLLM_SERVER_DEV_MODE": "1",
        "CUDA_VISIBLE_DEVICES": "4,5",
        TOKEN_ENV: "s3cret",
    }
    argv = started["argv"]
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {
        "backend": "nccl_checked"
    }
