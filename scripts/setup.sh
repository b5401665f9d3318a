#!/usr/bin/env bash
# Create .venv (if needed) and install titan_learner with its test tools.
# torch is installed first and pinned exactly: on CPU machines the 2.13.0 CPU wheel is on disk,
# while an unpinned install would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
