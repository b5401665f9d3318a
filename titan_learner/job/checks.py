"""The GRPO job's own checks, run by `validate` (so by `train` and `check`) before any compute.

Structure (what the file alone decides) is always an error. Inputs that live on the machine the
run is meant for (data files, the tokenizer directory) are errors there and warnings elsewhere
(`check` on a laptop for a cluster run); what can be checked wherever they exist is checked:
the keys of the first rows, that the tokenizer loads, that each reward imports.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

from titan_learner.config.derived import episode_tokens, longest_sequence
from titan_learner.config.env_values import multi_turn
from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.schema import Config, RewardSection
from titan_learner.data.errors import DataError
from titan_learner.data.files import read_rows, resolve
from titan_learner.job.wandb_run import require_wandb
from titan_learner.rewards.builtins import BUILTINS
from titan_learner.rewards.loading import RewardLoadError, load_function
from titan_learner.rewards.runner import reward_name
from titan_learner.vllm.checks import check_vllm_machine, check_vllm_structure

KEY_CHECK_ROWS = 5


def check_job_structure(config: Config, data_parallel: int) -> None:
    """What the file alone decides about the job."""
    source = config.source
    if not config.data.train_files:
        raise ConfigError(
            "none given; allowed: one or more local JSONL, JSON or Parquet files of prompts",
            source=source,
            where="[data] train_files",
        )
    if not config.reward and not config.env.class_:  # an environment's step may reward alone
        raise ConfigError(
            'no [[reward]] table; allowed: at least one, e.g. [[reward]] function = "math" '
            f'(built-ins: {", ".join(BUILTINS)}) or function = "my_rewards.py:score"',
            source=source,
            where="[[reward]]",
        )
    names: dict[str, int] = {}
    for index, section in enumerate(config.reward):
        where = f"[[reward]] #{index + 1}"
        check_reward_kind(config, section, where)
        if section.function == "regex":
            if not section.pattern:
                raise ConfigError("regex needs a pattern", source=source, where=f"{where} pattern")
            try:
                re.compile(section.pattern)
            except re.error as err:
                raise ConfigError(
                    f"{section.pattern!r} is not a regular expression ({err})",
                    source=source,
                    where=f"{where} pattern",
                ) from None
        name = reward_name(section)
        if name in names:
            raise ConfigError(
                f"two rewards are named {name!r} (#{names[name] + 1} and #{index + 1}); their "
                "metrics would collide; allowed: distinct names (set name = ...)",
                source=source,
                where=f"{where} name",
            )
        names[name] = index
    prompts = config.rollout.prompts_per_step
    if prompts % data_parallel:
        raise ConfigError(
            f"{prompts} prompts do not split over {data_parallel} data-parallel ranks; "
            f"allowed: a multiple of {data_parallel}",
            source=source,
            where="[rollout] prompts_per_step",
        )
    per_rank = prompts // data_parallel
    if per_rank % config.learner.grad_accum_steps:
        raise ConfigError(
            f"{per_rank} prompts per rank do not split into {config.learner.grad_accum_steps} "
            "micro-batches of whole groups; allowed: grad_accum_steps dividing prompts per rank",
            source=source,
            where="[learner] grad_accum_steps",
        )
    check_batch_shaping(config)
    if config.rollout.generator == "vllm":
        check_vllm_structure(config)


def check_batch_shaping(config: Config) -> None:
    """DAPO's batch shaping: dynamic sampling scores each round before it decides on the next
    (a collective between rounds, which the off-policy sampling thread cannot make), and the
    overlong buffer is a part of max_new_tokens."""
    rollout = config.rollout
    if rollout.dynamic_sampling and rollout.max_off_policy_steps:
        raise ConfigError(
            f"dynamic_sampling scores every round before sampling the next; with "
            f"max_off_policy_steps = {rollout.max_off_policy_steps} rollouts are sampled ahead "
            "in a thread; allowed: max_off_policy_steps = 0 with dynamic_sampling",
            source=config.source,
            where="[rollout] dynamic_sampling",
        )
    if rollout.overlong_buffer > rollout.max_new_tokens:
        raise ConfigError(
            f"{rollout.overlong_buffer} tokens is longer than max_new_tokens = "
            f"{rollout.max_new_tokens}; allowed: 0 (off) to {rollout.max_new_tokens}",
            source=config.source,
            where="[rollout] overlong_buffer",
        )


_DEVICE = re.compile(r"learner|cpu|cuda(:\d+)?")


def check_reward_kind(config: Config, section: RewardSection, where: str) -> None:
    """Exactly one of function, model and judge, and the keys of the kind given."""
    given = [k for k in ("function", "model", "judge") if getattr(section, k)]
    if len(given) != 1:
        found = {
            0: "none of function, model and judge",
            2: "both " + " and ".join(given),
            3: "all of function, model and judge",
        }[len(given)]
        raise ConfigError(
            f"{found}; allowed: exactly one, function = {' | '.join(map(repr, BUILTINS))} | "
            "'file.py:function', model = 'path/to/reward-model' or judge = { base_url, model, "
            "prompt, parse }",
            source=config.source,
            where=where,
        )
    if section.judge:
        check_judge(config, section.judge, f"{where} judge")
    if not section.function and section.workers is not None:
        raise ConfigError(
            "workers is for a function; allowed: batch_size and device for a reward model, "
            "judge.concurrency for a judge",
            source=config.source,
            where=f"{where} workers",
        )
    if section.model and not _DEVICE.fullmatch(section.device):
        raise ConfigError(
            f"{section.device!r}; allowed: learner, cpu, cuda or cuda:N",
            source=config.source,
            where=f"{where} device",
        )


def check_judge(config: Config, table: dict, where: str) -> None:
    """The judge table's keys, their types, its URL and its parse pattern (one group)."""
    from titan_learner.rewards.judge import JUDGE_KEYS, REQUIRED

    def error(message: str, key: str = "") -> ConfigError:
        return ConfigError(message, source=config.source, where=f"{where}.{key}" if key else where)

    for key in table:
        if key not in JUDGE_KEYS:
            raise error(
                f"unknown key {key!r}{did_you_mean(key, JUDGE_KEYS)}; allowed: "
                + ", ".join(JUDGE_KEYS)
            )
    for key in REQUIRED:
        if not isinstance(table.get(key), str) or not table[key]:
            raise error(f"missing or not a string; allowed: {JUDGE_KEYS[key]}", key)
    variable = table.get("api_key_env")
    if variable is not None and not (isinstance(variable, str) and variable.isidentifier()):
        raise error(f"{variable!r}; allowed: {JUDGE_KEYS['api_key_env']}", "api_key_env")
    if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", table["base_url"]):
        raise error(f"{table['base_url']!r}; allowed: {JUDGE_KEYS['base_url']}", "base_url")
    try:
        groups = re.compile(table["parse"]).groups
    except re.error as err:
        raise error(f"{table['parse']!r} is not a regular expression ({err})", "parse") from None
    if groups != 1:
        raise error(f"{table['parse']!r} has {groups} groups; allowed: exactly one", "parse")
    for key, low, kind in (
        ("temperature", 0, (int, float)),
        ("max_tokens", 1, int),
        ("concurrency", 1, int),
        ("retries", 0, int),
    ):
        value = table.get(key, low)
        if isinstance(value, bool) or not isinstance(value, kind) or value < low:
            raise error(f"{value!r}; allowed: {JUDGE_KEYS[key]}", key)


def check_sequence_length(config: Config, max_seq_len: int) -> None:
    """A prompt and its completion must fit the positions the model covers (its RoPE tables)."""
    if multi_turn(config):
        check_episode_length(config, max_seq_len)
        return
    longest_new = max(config.rollout.max_new_tokens, config.eval.max_new_tokens)
    needed = longest_sequence(config)
    budget = config.learner.max_tokens_per_microbatch
    trained = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    if budget and budget < trained:
        raise ConfigError(
            f"max_tokens_per_microbatch = {budget} is shorter than the longest training sequence "
            f"(max_prompt_tokens + max_new_tokens = {trained}); allowed: at least {trained}",
            source=config.source,
            where="[learner] max_tokens_per_microbatch",
        )
    if needed > max_seq_len:
        raise ConfigError(
            f"max_prompt_tokens + max_new_tokens = {config.data.max_prompt_tokens} + "
            f"{longest_new} = {needed} positions, but the model covers {max_seq_len} "
            "(max_seq_len); allowed: shorter prompts or completions, or a larger "
            "[model.overrides] max_seq_len",
            source=config.source,
            where="[data] max_prompt_tokens",
        )


def check_episode_length(config: Config, max_seq_len: int) -> None:
    """A whole episode must fit the model's positions and a token-budget micro-batch."""
    needed = episode_tokens(config)
    meaning = f"max_total_tokens = {config.env.max_total_tokens}"
    if not config.env.max_total_tokens:
        meaning = f"max_total_tokens = 0: max_prompt_tokens + max_turns x max_new_tokens = {needed}"
    budget = config.learner.max_tokens_per_microbatch
    if budget and budget < needed:
        raise ConfigError(
            f"max_tokens_per_microbatch = {budget} is shorter than the longest episode "
            f"([env] {meaning}); allowed: at least {needed}",
            source=config.source,
            where="[learner] max_tokens_per_microbatch",
        )
    if needed > max_seq_len:
        raise ConfigError(
            f"{meaning} positions, but the model covers {max_seq_len} (max_seq_len); allowed: a "
            "smaller max_total_tokens, or a larger [model.overrides] max_seq_len",
            source=config.source,
            where="[env] max_total_tokens",
        )


def check_job_inputs(
    config: Config,
    machine_check: Callable[[Callable[[], None]], None],
    model_vocab: int,
    world_size: int,
    data_parallel: int,
) -> None:
    """Data files, their keys, the tokenizer, the rewards and the vLLM engines, as far as
    they exist here.

    `machine_check(fn)` runs `fn` and turns a ConfigError about something missing on this
    machine into a warning where the run is meant for another machine.
    """
    base = Path(config.source).parent
    data = config.data
    key = data.messages_key or data.prompt_key
    for where, files in (
        ("[data] train_files", data.train_files),
        ("[data] eval_files", data.eval_files),
    ):
        for name in files:
            path = resolve(name, base)
            allowed = "a local JSONL, JSON or Parquet file"
            machine_check(partial(require_file, config, path, allowed, where))
            if path.is_file():
                _check_first_rows(config, path, [key, data.answer_key])
    _check_tokenizer(config, machine_check, model_vocab)
    machine_check(lambda: require_wandb(config))
    if config.rollout.generator == "vllm":
        check_vllm_machine(config, machine_check, world_size, data_parallel)
    if multi_turn(config):
        from titan_learner.job.episodes import load_env_parts

        load_env_parts(config)
    for index, section in enumerate(config.reward):
        if section.model:
            _check_reward_model(config, section, index, machine_check)
            continue
        if section.judge:
            _check_judge_inputs(config, section.judge, index, machine_check)
            continue
        if section.function in BUILTINS:
            continue
        try:
            load_function(section.function, base)
        except RewardLoadError as err:
            raise ConfigError(
                str(err), source=config.source, where=f"[[reward]] #{index + 1} function"
            ) from None


def require_file(config: Config, path: Path, allowed: str, where: str) -> None:
    """A file that must exist on this machine (for `machine_check`, which makes its absence a
    warning where the run is meant for another machine)."""
    if not path.is_file():
        raise ConfigError(
            f"{path} not found; allowed: {allowed}", source=config.source, where=where
        )


def _check_first_rows(config: Config, path: Path, keys: list[str]) -> None:
    try:
        rows = read_rows(path, limit=KEY_CHECK_ROWS)  # the job reads them all later
    except DataError as err:
        raise ConfigError(str(err), source=config.source, where="[data]") from None
    if not rows:
        raise ConfigError(f"{path} holds no rows", source=config.source, where="[data]")
    for row in rows[:KEY_CHECK_ROWS]:
        missing = [k for k in keys if k not in row.values]
        if missing:
            raise ConfigError(
                f"{row.origin}: missing key {missing[0]!r}; the row has: "
                f"{', '.join(sorted(row.values)) or 'no keys'}",
                source=config.source,
                where="[data]",
            )


def _check_tokenizer(
    config: Config, machine_check: Callable[[Callable[[], None]], None], model_vocab: int
) -> None:
    from titan_learner.data.tokenizer import (
        load_tokenizer,
        require_tokenizer_dir,
        tokenizer_dir,
        tokenizer_key,
    )

    machine_check(lambda: require_tokenizer_dir(config))
    if not tokenizer_dir(config).is_dir():
        return
    tokenizer = load_tokenizer(config)
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab}; allowed: a model vocabulary of at least {tokenizer.vocab_size}",
            source=config.source,
            where=tokenizer_key(config),
        )


def _check_reward_model(
    config: Config,
    section: RewardSection,
    index: int,
    machine_check: Callable[[Callable[[], None]], None],
) -> None:
    """The directory, its head and its tokenizer (not its weights); and its device."""
    import torch

    from titan_learner.rewards.reward_model import reward_model_problem

    where = f"[[reward]] #{index + 1}"
    path = resolve(section.model, Path(config.source).parent)

    def present() -> None:
        if not path.exists():
            raise ConfigError(
                f"{path} not found; allowed: a Hugging Face reward model directory",
                source=config.source,
                where=f"{where} model",
            )

    machine_check(present)
    if path.exists() and (problem := reward_model_problem(path)) is not None:
        raise ConfigError(problem, source=config.source, where=f"{where} model")
    if section.device.startswith("cuda"):
        ordinal = int(section.device.partition(":")[2] or 0)
        visible = torch.cuda.device_count()

        def on_this_machine() -> None:
            if ordinal >= visible:
                raise ConfigError(
                    f"{section.device!r} but this machine has {visible} CUDA device(s); "
                    "allowed: learner, cpu, or a visible cuda:N",
                    source=config.source,
                    where=f"{where} device",
                )

        machine_check(on_this_machine)


def _check_judge_inputs(
    config: Config, table: dict, index: int, machine_check: Callable[[Callable[[], None]], None]
) -> None:
    """The judge's template (present, valid Jinja), its token's environment variable and the
    proxy the environment sends it through (an http:// one)."""
    import os

    import jinja2

    from titan_learner.rewards.proxy_route import proxy_for

    variable = table.get("api_key_env")

    def token_set() -> None:
        if variable and not os.environ.get(variable):
            raise ConfigError(
                f"the environment variable {variable} is not set (or empty); allowed: the "
                "judge's bearer token in it",
                source=config.source,
                where=f"[[reward]] #{index + 1} judge.api_key_env",
            )

    machine_check(token_set)

    def proxy_usable() -> None:
        try:
            proxy_for(table["base_url"])
        except ValueError as err:
            raise ConfigError(
                f"{err}; allowed: an http:// proxy in HTTP_PROXY / HTTPS_PROXY, or the host "
                "in NO_PROXY",
                source=config.source,
                where=f"[[reward]] #{index + 1} judge.base_url",
            ) from None

    machine_check(proxy_usable)
    where = f"[[reward]] #{index + 1} judge.prompt"
    path = resolve(table["prompt"], Path(config.source).parent)
    machine_check(partial(require_file, config, path, "a Jinja template file", where))
    if path.is_file():
        try:
            jinja2.Environment().parse(path.read_text())
        except jinja2.TemplateSyntaxError as err:
            raise ConfigError(
                f"{path}:{err.lineno}: not a Jinja template ({err.message})",
                source=config.source,
                where=where,
            ) from None
