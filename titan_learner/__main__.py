"""`python -m titan_learner check --config FILE [--set k=v ...] [--world-size N]`
and `python -m titan_learner export --checkpoint DIR --out HF_DIR [--dtype D] [--config FILE]
[--step N]`."""

from __future__ import annotations

import argparse
import os
import sys

from titan_learner.schema import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_learner")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a config and print what it resolves to")
    check.add_argument("--config", required=True, help="TOML file")
    check.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    check.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="number of processes the run will have (default: $WORLD_SIZE or 1)",
    )
    export = commands.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory (safetensors)"
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
    args = parser.parse_args(argv)
    if args.command == "export":
        return _export(args)

    from titan_learner.check import plan, render
    from titan_learner.config import load_config

    if args.world_size < 1:
        print(f"error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, args.overrides)
        print(render(config, plan(config, args.world_size)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _export(args: argparse.Namespace) -> int:
    from titan_learner.checkpoint import CheckpointError
    from titan_learner.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(
            args.checkpoint, args.out, args.dtype, config=args.config, step=args.step
        )
    except (ConfigError, CheckpointError, ExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
