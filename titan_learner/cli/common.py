"""What every subcommand and script shares: `--config FILE` with `--set` overrides, and a user
error as one line on stderr with exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from titan_learner.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_learner.config.schema import Config

USER_ERROR = 2
RANK0_GRACE_S = 5.0
INTERRUPTED = 130  # what a shell reports for Ctrl-C


def add_config_arguments(
    parser: argparse.ArgumentParser, default: str | None = None, required: bool = True
) -> None:
    """`--config FILE` (required unless `default`, or `required=False`: the command checks) and
    repeatable `--set SECTION.KEY=VALUE`; shared by the subcommands and the scripts."""
    parser.add_argument(
        "--config",
        required=required and default is None,
        default=default,
        help="the run's TOML file",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (a TOML value; a bare word is a string); repeatable",
    )


def config_from_arguments(args: argparse.Namespace) -> Config:
    """The config `add_config_arguments` named; a bad one is one line on stderr and exit 2
    (for the scripts under scripts/, which have no other way to report it)."""
    from titan_learner.config.toml import load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def user_error(err: Exception) -> int:
    """One line on stderr, from one process: under torchrun every rank fails alike.

    torchrun stops the other ranks as soon as one exits, so the other ranks give rank 0 a few
    seconds to print its line first: otherwise a rank 0 a moment slower is stopped silently.
    """
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {err}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK0_GRACE_S)
    return USER_ERROR
