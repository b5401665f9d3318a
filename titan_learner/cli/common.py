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
CLAIM_TIMEOUT_S = 5.0  # reaching the launcher's store to claim the error line
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
    """One line on stderr, from one process: under torchrun every rank may fail alike.

    Rank 0's line is preferred: the other ranks give it a few seconds to claim the line first.
    A rank may also fail alone (a rollout server dies under it) while rank 0 waits for it in a
    collective; torchrun stops every rank once one exits, so after its grace such a rank prints
    its own line, unless rank 0 has claimed it by then. The claim is one compare-and-set on
    the launcher's store, so the line is printed exactly once.
    """
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank != 0:
        time.sleep(RANK0_GRACE_S)
    if _claims_error_line(rank):
        print(f"error: {err}", file=sys.stderr, flush=True)
    return USER_ERROR


def _claims_error_line(rank: int) -> bool:
    """Whether this rank prints the run's error line: the first rank to claim it on the
    launcher's store, keyed by run and restart; rank 0 where there is no store to ask (a
    world of one, or a launcher store that is gone)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) == 1 or "MASTER_PORT" not in os.environ:
        return rank == 0
    from datetime import timedelta

    import torch.distributed as dist

    from titan_learner.model.elastic_store import launcher_store

    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"titan_learner/error_line/{run}/{restart}"
    try:
        store = launcher_store(timedelta(seconds=CLAIM_TIMEOUT_S))
        return store.compare_set(key, "", str(rank)) == str(rank).encode()
    except (dist.DistError, OSError):
        return rank == 0
