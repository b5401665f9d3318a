#!/usr/bin/env bash
# GPU smoke: the first thing to run whenever a GPU machine is lent. One run, at most 8 minutes
# on an H200; every check fails the smoke (exit 1) rather than skipping: no CUDA, a missing
# import, a non-finite step or a timeout all end in failure.
#
#   bash scripts/prepare_gpu_wheels.sh     # here, with network: .gpu_wheels/ (~36 MiB)
#   bash scripts/gpu_smoke.sh              # there, with .gpu_wheels/ carried with the tree
#
# On a machine without the project's dependencies (the lent H200 has Python 3.12, its own torch
# and transformers, no network), the carried wheels go into .gpu_venv, a venv that sees the
# machine's packages, and titan_learner runs from source (PYTHONPATH): nothing replaces its torch.
# Checks, in order:
#   env      CUDA present, every import, versions (vLLM is reported, not required: no vLLM wheel
#            fits the carry, so its GPU paths, NCCL sink refusal and engine placement, stay
#            untested there)
#   nccl     torch's libnccl.so.2 as nccl_m2n's NCCL check reads it (file, version) against
#            torch.cuda.nccl.version(); whether it is new enough for m2n is reported
#   parity   3 GRPO updates of one model on CUDA against the CPU reference (fp32, TF32 off)
#   step     benchmarks/bench_step.py, a ~190M model in bf16 with flex attention and compile: the
#            learner/bare-TorchTitan ratio
#   job      20 steps of the embedded default on CUDA, through `titan_learner train`
#   job_k1   the same one step off-policy: the log-prob mismatch on every step, tokens/s
#            against job's (the measurement the GPU configs' k = 1 default waits for)
#   chunked  chunked log-probs against dense ones, on CUDA
#   vllm_ipc, vllm_gloo  where `import vllm` works: a colocated engine takes a trained learner's
#            weights through vLLM's RL API (ipc, then our gloo backend) and serves what
#            transformers computes; where it does not, one line says these did not run
#   vllm_sleep  the same through ipc with [rollout.vllm] sleep_level 1: the GPU memory the
#            engine gives back while asleep
# Not here: nccl and nccl_m2n move weights to servers on other GPUs, and NCCL takes one rank per
# device (a lent machine has one GPU); their whole-update tests need 2 GPUs, nccl_m2n also
# NVIDIA's nccl-extensions.
# Numbers go to $OUT/gpu_smoke.jsonl (OUT: the lent machine's output folder; else
# outputs/gpu_smoke), each check's log beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/gpu_smoke}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_smoke.jsonl"
: >"$RESULTS"
PYTHON="${PYTHON:-python3}"
BUDGET_S=470  # under 8 minutes in all
failed=()

if ! "$PYTHON" -c "import torchtitan.config, torchrl, tensordict, torchdata, xxhash" 2>/dev/null; then
    if [ ! -d .gpu_wheels ]; then
        echo "gpu_smoke: the project's dependencies are missing and .gpu_wheels/ is not here" \
            "(bash scripts/prepare_gpu_wheels.sh where PyPI is reachable, then carry it)" >&2
        exit 1
    fi
    "$PYTHON" -m venv --system-site-packages .gpu_venv &&
        .gpu_venv/bin/python -m pip install --quiet --no-index --no-deps .gpu_wheels/*.whl ||
        { echo "gpu_smoke: installing .gpu_wheels/ failed" >&2; exit 1; }
    PYTHON=.gpu_venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# vLLM loads our gloo backend in its engine processes from the package's entry point
# (vllm.general_plugins, pyproject.toml); titan_learner runs from source here, so a minimal
# dist-info on PYTHONPATH declares it where no installed titan_learner does.
if ! "$PYTHON" -c "import importlib.metadata as m; m.distribution('titan_learner')" 2>/dev/null; then
    "$PYTHON" - <<'PY' || { echo "gpu_smoke: declaring the vLLM plugin failed" >&2; exit 1; }
import pathlib, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(".gpu_meta") / f"titan_learner-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: titan_learner\nVersion: {project['version']}\n")
lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
         for group, points in project["entry-points"].items()]
(info / "entry_points.txt").write_text("\n".join(lines))
PY
    export PYTHONPATH="$PWD/.gpu_meta:$PYTHONPATH"
fi

check() {  # check NAME LIMIT_S COMMAND...: run it under a timeout, log it, record failure
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET_S - SECONDS))
    ((limit > left)) && limit=$left
    echo "=== gpu_smoke: ${name} (timeout ${limit}s) ==="
    if ((limit < 20)); then
        echo "gpu_smoke: ${name}: FAILED (out of time budget)"
        failed+=("${name}")
        return
    fi
    local rc=0
    timeout --kill-after=10 "${limit}" "$@" >"$OUT_DIR/${name}.log" 2>&1 || rc=$?
    grep -E '^\{"check"|ratio learner/baseline|^of which' "$OUT_DIR/${name}.log" | tee -a "$RESULTS"
    if ((rc != 0)); then
        grep -v '^{"check"' "$OUT_DIR/${name}.log" | tail -n 5
        echo "gpu_smoke: ${name}: FAILED (exit ${rc}$( ((rc == 124 || rc == 137)) && echo ", timed out"))"
        failed+=("${name}")
    fi
}

check env 60 "$PYTHON" scripts/gpu_smoke.py env
if ((${#failed[@]})); then
    echo "gpu_smoke: the environment is not usable; nothing else ran" >&2
    exit 1
fi
check nccl 30 "$PYTHON" scripts/gpu_smoke.py nccl
check parity 60 "$PYTHON" scripts/gpu_smoke.py parity
# Values are TOML (titan_learner.config.apply_overrides): strings keep their double quotes.
check step 200 "$PYTHON" benchmarks/bench_step.py --config configs/debug.toml \
    --set 'model.attention="flex"' --set 'parallelism.param_dtype="bfloat16"' \
    --set model.overrides.dim=1024 --set model.overrides.n_layers=8 \
    --set model.overrides.n_heads=16 --set model.overrides.n_kv_heads=8 \
    --set model.overrides.hidden_dim=4096 --set model.overrides.vocab_size=32000 \
    --set run.seq_len=2048 --set run.batch_size=4 --set compile.enable=true --steps 5 --warmup 2
check job 150 "$PYTHON" scripts/gpu_smoke.py job "$OUT_DIR/toy" --steps 20
check job_k1 100 "$PYTHON" scripts/gpu_smoke.py job "$OUT_DIR/toy_k1" --steps 20 --off-policy-steps 1
check chunked 60 "$PYTHON" scripts/gpu_smoke.py chunked
check shared 60 "$PYTHON" scripts/gpu_smoke.py shared
if "$PYTHON" -c "import vllm" 2>/dev/null; then
    check vllm_ipc 150 "$PYTHON" scripts/gpu_smoke.py vllm --transfer ipc
    check vllm_gloo 150 "$PYTHON" scripts/gpu_smoke.py vllm --transfer gloo
    check vllm_sleep 150 "$PYTHON" scripts/gpu_smoke.py vllm --transfer ipc --sleep-level 1
else
    echo "=== gpu_smoke: vllm_ipc, vllm_gloo, vllm_sleep did not run: vllm does not import here ==="
fi

if ((${#failed[@]})); then
    echo "gpu_smoke: ${#failed[@]} check(s) failed: ${failed[*]} (${SECONDS}s); numbers in $RESULTS"
    exit 1
fi
echo "gpu_smoke: all checks passed (${SECONDS}s); numbers in $RESULTS"
