"""`python -m titan_learner {train,check,export}`: the same command line as `titan-learner`."""

import sys

from titan_learner.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m titan_learner"))
