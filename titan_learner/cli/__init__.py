"""The one command line: `titan-learner {train,check,export,serve}` (also `python -m titan_learner`).

Every user error (config, checkpoint, export) ends in one `error: ...` line on stderr and exit
code 2; `--help` on each subcommand says what it takes.
"""

from __future__ import annotations

import argparse
import os
import sys

from titan_learner.cli.common import (
    INTERRUPTED,
    USER_ERROR,
    add_config_arguments,
    config_from_arguments,
    user_error,
)
from titan_learner.config.errors import ConfigError

__all__ = ["add_config_arguments", "config_from_arguments", "main"]  # scripts/ use the first two


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Train LLM policies with TorchTitan sharding and TorchRL losses."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="run the GRPO job of a config (alone, or under torchrun on every rank)",
        description="Run the GRPO job: rollouts, rewards, updates, weight pushes, checkpoints.",
    )
    add_config_arguments(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue from the latest checkpoint in output_dir; `--resume auto`: also start "
        "fresh when it has none, for a first launch and every restart alike",
    )
    shown = train.add_mutually_exclusive_group()
    shown.add_argument(
        "--quiet",
        action="store_const",
        dest="verbosity",
        const="quiet",
        default="normal",
        help="print no step and no evaluation (the files get them all)",
    )
    shown.add_argument(
        "--verbose",
        action="store_const",
        dest="verbosity",
        const="verbose",
        help="print every metric every [logging] log_every steps (above the bar on a terminal)",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="move a previous run in output_dir aside (to <output_dir>.old-<time>) and start anew",
    )
    check = commands.add_parser(
        "check",
        help="validate a config and print what it resolves to (builds nothing)",
        description="Validate a config; print the resolved config, mesh, size and memory.",
    )
    add_config_arguments(check, required=False)
    check.add_argument(
        "--explain",
        metavar="KEY",
        help="describe one key (type, default, allowed values, meaning) and exit, e.g. "
        "--explain rollout.group_size; docs/config.md has them all",
    )
    check.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="number of processes the run will have (default: $WORLD_SIZE or 1)",
    )
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (safetensors, tokenizer)",
        description="Write a DCP checkpoint as a Hugging Face model directory that transformers "
        "and `vllm serve` load as it is: weights, config, the run's tokenizer and chat template, "
        "generation config with the run's EOS ids.",
    )
    export.add_argument(
        "--checkpoint", required=True, help="checkpoint root (or one step directory)"
    )
    export.add_argument("--out", required=True, help="new (or empty) output directory")
    export.add_argument(
        "--dtype",
        default=None,
        help="bf16, fp16 or fp32 (or bfloat16, float16, float32); default: [learner] export_dtype",
    )
    export.add_argument(
        "--config", default=None, help="TOML file (default: config.toml of the checkpoint root)"
    )
    export.add_argument(
        "--step", type=int, default=None, help="step to export (default: the latest)"
    )
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a [model.lora] run's adapters alone, as a PEFT directory (adapter_config.json, "
        "adapter_model.safetensors) that peft and `vllm serve --enable-lora` load",
    )
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the safetensors into shards of at most this size, with an index "
        "(bytes, or e.g. 500MB, 5GB; default: 5GB)",
    )
    from titan_learner.cli.serve import add_serve_parser

    add_serve_parser(commands)
    return parser


def _resume_mode(value: str) -> str:
    from titan_learner.job.run_directory import AUTO

    if value != AUTO:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a resume mode; allowed: --resume alone or --resume {AUTO}"
        )
    return value


def main(argv: list[str] | None = None, prog: str = "titan-learner") -> int:
    args = build_parser(prog).parse_args(argv)
    from titan_learner.cli.serve import serve

    command = {"train": _train, "check": _check, "export": _export, "serve": serve}[args.command]
    return command(args)


def console() -> None:
    """The `titan-learner` console script."""
    sys.exit(main())


def _user_errors() -> tuple[type[Exception], ...]:
    """What `train` reports as one line and exit 2: bad config, data, rewards, checkpoint, a
    user environment that raises, a rollout server that is down or refuses, a vLLM engine
    that does not start."""
    from titan_learner.checkpoint.errors import CheckpointError
    from titan_learner.data.errors import DataError
    from titan_learner.env.environment import EnvError
    from titan_learner.rewards.loading import RewardLoadError
    from titan_learner.rewards.runner import RewardError
    from titan_learner.vllm.errors import EngineStartError
    from titan_learner.vllm.server_client import ServerError

    return (
        ConfigError,
        DataError,
        RewardError,
        RewardLoadError,
        CheckpointError,
        EnvError,
        ServerError,
        EngineStartError,
    )


def _train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from titan_learner.config.toml import load_config
    from titan_learner.job.grpo import run
    from titan_learner.rollout.pipeline import GeneratorFailed

    try:
        run(
            load_config(args.config, args.overrides),
            resume=args.resume,
            overwrite=args.overwrite,
            verbosity=args.verbosity,
        )
        if dist.is_initialized():
            # Every rank reaches the teardown together: a rank that tears its process group
            # down while another still uses it (rank 0 drawing the curves) can abort at exit.
            dist.barrier()
    except _user_errors() as err:
        return user_error(err)
    except GeneratorFailed as err:
        # Sampled ahead (max_off_policy_steps > 0), a server that died or an environment that
        # raised fails the rollout thread: the same one line as on the learner's thread.
        if not isinstance(err.__cause__, _user_errors()):
            raise
        return user_error(err.__cause__)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(
                "stopped: interrupted (Ctrl-C); the last checkpoint is unchanged", file=sys.stderr
            )
        return INTERRUPTED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _check(args: argparse.Namespace) -> int:
    from titan_learner.cli.check import plan, render
    from titan_learner.config.toml import load_config

    if args.explain is not None:
        from titan_learner.config.reference import explain

        try:
            print(explain(args.explain))
        except ConfigError as err:
            return user_error(err)
        return 0
    if args.config is None:
        print("error: check needs --config FILE (or --explain KEY)", file=sys.stderr)
        return USER_ERROR
    if args.world_size < 1:
        print(f"error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return USER_ERROR
    from titan_learner.data.errors import DataError

    try:
        config = load_config(args.config, args.overrides)
        print(render(config, plan(config, args.world_size)))
    except (ConfigError, DataError) as err:  # DataError: the prompts, as train reads them
        return user_error(err)
    return 0


def _shard_size(value: str) -> int | str:
    """`--max-shard-size` as save_pretrained takes it: a plain number is bytes."""
    return int(value) if value.isdigit() else value


def _export(args: argparse.Namespace) -> int:
    from titan_learner.checkpoint.adapter_export import export_adapter
    from titan_learner.checkpoint.errors import CheckpointError
    from titan_learner.checkpoint.hf_export import ExportError, export_checkpoint

    try:
        if args.adapter:
            out = export_adapter(
                args.checkpoint, args.out, args.dtype, config=args.config, step=args.step
            )
            print(f"exported the LoRA adapters of {args.checkpoint} to {out}")
            return 0
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            args.dtype,
            config=args.config,
            step=args.step,
            max_shard_size=_shard_size(args.max_shard_size),
        )
    except (ConfigError, CheckpointError, ExportError) as err:
        return user_error(err)
    print(f"exported {args.checkpoint} to {out}")
    return 0
