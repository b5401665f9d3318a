"""`python -m titan_learner.train ...`: an alias of `python -m titan_learner train ...`."""

from __future__ import annotations

import sys

from titan_learner.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(
        ["train", *(sys.argv[1:] if argv is None else argv)], prog="python -m titan_learner"
    )


if __name__ == "__main__":
    sys.exit(main())
