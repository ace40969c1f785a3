#!/usr/bin/env bash
# One pass of pymem on a GPU machine, sized for a short lease: build, the CUDA tests, the CUDA
# demo, then the GPU benchmarks, each stage capped so that the whole ends by DEADLINE seconds.
# Logs and JSON go to OUT (default ./gpu_out). Run from the repository root:
#     OUT=/tmp/gpu DEADLINE=480 bash bench/gpu_check.sh
# Stages run in priority order; one that fails is reported and the next one runs.
set -uo pipefail
OUT=${OUT:-gpu_out}
DEADLINE=${DEADLINE:-480}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-16}
PY=${PY:-python3}
LOG="$OUT/all.log"
: >"$LOG"

stage() {  # stage NAME CAP_SECONDS COMMAND...: runs COMMAND under min(CAP, what is left)
    local name=$1 cap=$2; shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped, ${left}s left" | tee -a "$LOG"; return; fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "=== $name (cap ${cap}s, at ${SECONDS}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 5 "$cap" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0))s" | tee -a "$LOG"
    return $rc
}

stage env 20 bash -c "nvidia-smi -L; $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'"
if ! stage build 240 $PY setup.py build_ext --inplace; then
    tail -40 "$LOG"; exit 1
fi
ls -la pymem/*.so | tee -a "$LOG"
stage tests 200 $PY -m pytest -q -p no:cacheprovider --timeout 150 \
    tests/test_runtime_cuda.py tests/test_cuda_lib.py tests/test_cupy.py
stage demo 90 $PY -m pymem demo --device cuda
stage hf_checkpointing 170 $PY bench/hf_checkpointing_bench.py --device cuda --model gpt2-small \
    --steps 6 --warmup 3 --limit 50 --only "checkpointed peak,of plain" --json "$OUT/hf_gpt2_small.json"
stage overhead 120 $PY bench/gpu_figures/h100-2026-11-25/demo_prof.py
stage offload 90 $PY bench/offload_gpu_bench.py --models transformer --ratios 0.5 \
    --json "$OUT/offload_gpu.json"
grep -E '^=== |passed|failed|slowdown|RESULT|ratio |unmanaged|pymem at|plain|hf-checkpointing' "$LOG" | tail -60
