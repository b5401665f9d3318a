#!/usr/bin/env bash
# GPU smoke test: the learner and its TorchTitan baseline on one CUDA device, through
# scripts/bench_step.py, in the settings the CPU tests cannot reach: bf16 FSDP mixed precision,
# flex attention and torch.compile.
#
#   PYTHON=.venv/bin/python scripts/gpu_smoke.sh
#
# Runs (each under `timeout`, the whole script well under 10 minutes on an H200):
#   1. debug model grown to ~190M parameters, bf16 + flex + compile
#   2. the same without compile (separates compile problems from the rest)
#   3. configs/qwen3_1.7b_grpo.toml at its real shape, from a seeded random init (no
#      weights needed), one micro-batch per step
# Prints "gpu_smoke: no CUDA device, skipping" and exits 0 where there is no CUDA device.
# Exits 1 if any run failed or timed out (the others still run).
set -euo pipefail

PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."

if ! "$PYTHON" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    echo "gpu_smoke: no CUDA device, skipping"
    exit 0
fi

BUDGET_S=560  # runs are cut at this many seconds into the script (+10 s kill grace): < 10 min
RUN_LIMIT_S=240
failed=()

# Values are TOML (titan_learner.config.apply_overrides): strings keep their double quotes.
GROWN_DEBUG=(
    --set 'model.attention="flex"'
    --set 'parallelism.param_dtype="bfloat16"'
    --set model.overrides.dim=1024
    --set model.overrides.n_layers=8
    --set model.overrides.n_heads=16
    --set model.overrides.n_kv_heads=8
    --set model.overrides.hidden_dim=4096
    --set model.overrides.vocab_size=32000
    --set run.seq_len=2048
    --set run.batch_size=4
)

run() {
    local name="$1"
    shift
    local limit=$((BUDGET_S - SECONDS))
    if ((limit > RUN_LIMIT_S)); then
        limit=$RUN_LIMIT_S
    fi
    echo
    echo "=== gpu_smoke: ${name} (timeout ${limit}s) ==="
    if ((limit < 30)); then
        echo "gpu_smoke: ${name}: skipped, out of time budget"
        failed+=("${name}")
        return
    fi
    local rc=0
    # SIGTERM at the limit, SIGKILL 10 s later for a process stuck in a collective.
    timeout --kill-after=10 "${limit}" "$PYTHON" scripts/bench_step.py "$@" || rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "gpu_smoke: ${name}: FAILED (timed out after ${limit}s)"
        failed+=("${name}")
    elif ((rc != 0)); then
        echo "gpu_smoke: ${name}: FAILED (exit ${rc})"
        failed+=("${name}")
    fi
}

run "debug 190M bf16 flex compile" --config configs/debug.toml "${GROWN_DEBUG[@]}" \
    --set compile.enable=true --steps 5 --warmup 2
run "debug 190M bf16 flex eager" --config configs/debug.toml "${GROWN_DEBUG[@]}" \
    --set compile.enable=false --steps 5 --warmup 1
# No weights on a smoke machine: hf_checkpoint="" means "none", the seeded random init.
run "qwen3 1.7B bf16 flex compile, random init" --config configs/qwen3_1.7b_grpo.toml \
    --set 'model.hf_checkpoint=""' --set learner.grad_accum_steps=1 --steps 5 --warmup 2

echo
if ((${#failed[@]})); then
    echo "gpu_smoke: ${#failed[@]} run(s) failed: $(IFS=';'; echo "${failed[*]}") (${SECONDS}s)"
    exit 1
fi
echo "gpu_smoke: all runs passed (${SECONDS}s)"
