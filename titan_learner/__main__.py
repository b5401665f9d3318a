"""`python -m titan_learner check --config FILE [--set k=v ...] [--world-size N]`."""

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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
