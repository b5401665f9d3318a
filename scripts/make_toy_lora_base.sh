#!/usr/bin/env bash
# The base configs/toy_lora.toml adapts: the embedded default trained for 100 steps with every
# weight (mean reward ~0.3, short of the 0.9 it reaches at ~250), then exported as a Hugging
# Face directory with its tokenizer, outputs/toy_lora_base/hf. A random base gives LoRA little
# to adapt (measured: 0.14 after 200 steps at rank 16), as the LoRA papers start from a
# pretrained model. ~1 min on 2 cores.
#   bash scripts/make_toy_lora_base.sh && .venv/bin/python -m titan_learner train --config configs/toy_lora.toml
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT=outputs/toy_lora_base
if [ -f "$OUT/hf/config.json" ]; then
  echo "$OUT/hf exists"
  exit 0
fi
rm -rf "$OUT"
"$PY" -m titan_learner train --config configs/toy_grpo.toml --set run.steps=100 \
  --set checkpoint.interval=100 --set eval.every_steps=0 --set "run.output_dir=\"$OUT\""
"$PY" -m titan_learner export --checkpoint "$OUT/checkpoints" --out "$OUT/hf" --dtype fp32
