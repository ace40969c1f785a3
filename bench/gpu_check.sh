#!/usr/bin/env bash
# One pass of pymem on a GPU machine, sized for a short lease: build, the CUDA tests, the CUDA
# demo, then the GPU benchmarks, each stage capped so that the whole ends by DEADLINE seconds.
# Logs and JSON go to OUT (default ./gpu_out). Run from the repository root:
#     OUT=/tmp/gpu DEADLINE=480 bash bench/gpu_check.sh
# STAGES picks stages (default: env build tests demo overhead hf calib offload; "profile" reruns
# the 0.5 delta run of gpu_overhead.py under cProfile; "calib" is the simulator's calibration); TESTS, HF_ARGS and HF_ONLY change what the
# tests and hf stages run.
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

STAGES=${STAGES:-"env build tests demo overhead hf calib offload"}
CALIB_ARGS=${CALIB_ARGS:-"--models gpt,cnn --budgets 1.0,0.5,0.3 --measure-timeout 60"}
HF_ARGS=${HF_ARGS:-"--steps 6 --warmup 3 --limit 50"}
HF_ONLY=${HF_ONLY:-"checkpointed peak,of plain"}
want() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

want env && stage env 20 bash -c "nvidia-smi -L; $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'"
if want build; then
    if ! stage build 240 $PY setup.py build_ext --inplace; then tail -40 "$LOG"; exit 1; fi
    ls -la pymem/*.so | tee -a "$LOG"
fi
want tests && stage tests 200 $PY -m pytest -q -p no:cacheprovider --timeout 150 ${TESTS:-tests/test_runtime_cuda.py tests/test_cuda_lib.py tests/test_cupy.py}
want demo && stage demo 90 $PY -m pymem demo --device cuda
want overhead && stage overhead 120 $PY bench/gpu_overhead.py --json "$OUT/gpu_overhead.json"
# shellcheck disable=SC2086
want hf && stage hf_checkpointing 170 $PY bench/hf_checkpointing_bench.py --device cuda --model gpt2-small \
    $HF_ARGS --only "$HF_ONLY" --json "$OUT/hf_gpt2_small.json"
# shellcheck disable=SC2086
want calib && stage calib 160 $PY bench/sim_calibration.py --device cuda --gpu "${CALIB_GPU:-h200}" $CALIB_ARGS \
    --json "$OUT/sim_calibration.json"
want offload && stage offload 90 $PY bench/offload_gpu_bench.py --models transformer --ratios 0.5 \
    --json "$OUT/offload_gpu.json"
want profile && stage profile 60 $PY bench/gpu_overhead.py --configs 0.5:delta --profile 0.5:delta
grep -E '^=== |passed|failed|slowdown|x \(last|ratio |unmanaged|pymem at|plain|hf-checkpointing|bitwise|error|floor' "$LOG" | tail -60
