#!/usr/bin/env bash
# The GPU path proven on a GPU, in one command: the CUDA tests, the kernel tables, the engine end
# to end, a launch-config sweep in the time left, then BENCHMARKS.md, each step time-boxed so that
# a failing or slow step does not eat the rest (8 minutes in all on an H100).
#
#   bench/gpu_check.sh [OUTDIR]          # on a CUDA machine; OUTDIR defaults to $OUT, else out/gpu_check
#   bench/gpu_check.sh --cpu [OUTDIR]    # the same steps on CPU: tiny shapes, Triton's interpreter
#   bench/gpu_check.sh --quick [OUTDIR]  # the CUDA tests, kernel tables and end to end only (~7 min)
#   bench/gpu_check.sh --rest [OUTDIR]   # the whole sweep, then the kernel tests on the GPU (~6
#       min): a second device call after the full check, whose 8 minutes leave those steps
#       little time; their results join OUTDIR's steps and BENCHMARKS.md (give the full check's
#       OUTDIR: the default out/gpu_check lies in the repository, which a warm device machine keeps)
#
# Needs torch, triton, transformers, safetensors, rich, click and pytest (not gguf, datasets or
# compressed-tensors: the calibration tests read their text without datasets where it is
# missing). The server's GPU test also needs fastapi, uvicorn and prometheus_client: where the
# environment lacks them, .gpu-vendor/ at the repository root goes on PYTHONPATH (ahead of the
# environment's packages, so it should hold only what the environment lacks; for a GPU image
# with Python 3.12, 18 MB: `pip install --no-deps --target .gpu-vendor --python-version 3.12
# --only-binary=:all: -c constraints.txt fastapi starlette pydantic pydantic_core annotated-types
# annotated-doc typing-inspection opentelemetry-api anyio sniffio idna h11 uvicorn
# prometheus_client`; a device run carries .gpu-vendor), else that test is left out. Writes
# OUTDIR/BENCHMARKS.md, the steps' logs and JSON; exits non-zero when CUDA is missing (without
# --cpu) or a step failed.
set -u
cd "$(dirname "$0")/.."
CPU=0
QUICK=0
REST=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
if [ "${1:-}" = "--rest" ]; then REST=1; shift; fi
if [ "$REST" = 1 ]; then DEST=${1:-out/gpu_check}; else DEST=${1:-${OUT:-out/gpu_check}}; fi
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SERVE_DEPS="import fastapi, uvicorn, prometheus_client"
if [ -d .gpu-vendor ] && ! python -c "$SERVE_DEPS" 2>/dev/null; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-vendor"
fi
GPU_TESTS=(tests/calib/test_stream_cuda.py tests/infer tests/kernels)
if python -c "$SERVE_DEPS" 2>/dev/null; then GPU_TESTS+=(tests/serve/test_cuda_serve.py); fi
if [ "$CPU" = 0 ] && ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); pass --cpu for the CPU run" >&2
    exit 1
fi
export QUANTSPEC_CPU_KERNELS=${QUANTSPEC_CPU_KERNELS:-0}  # the GPU run needs no CPU kernel build (minutes)
START=$(date +%s)
if [ "$REST" = 1 ]; then  # this run's sweep, kernel tests and report replace the full check's
    touch "$DEST/steps.tsv"
    grep -v -e $'^kernel_tests\t' -e $'^sweep\t' -e $'^report\t' "$DEST/steps.tsv" > "$DEST/steps.tsv.new"
    mv "$DEST/steps.tsv.new" "$DEST/steps.tsv"
else
    : > "$DEST/steps.tsv"
fi
FAILED=0

# step NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, output in DEST/NAME.log
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (at most ${limit}s)"
    timeout -k 10 "$limit" "$@" > "$DEST/$name.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || FAILED=1
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$DEST/steps.tsv"
    tail -n 3 "$DEST/$name.log"
}

# one line per test as it finishes, so that a step cut by its time box still shows how far it got;
# pytest-timeout (where installed) ends a test that hangs instead of the whole step
PYTEST=(python -m pytest -v -p no:cacheprovider -rfE --tb=short --durations=10)
if python -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=60); fi
if [ "$CPU" = 0 ] && [ "$REST" = 1 ]; then
    step sweep 110 python bench/kernels.py --sweep-only --out "$DEST"
    step kernel_tests 280 "${PYTEST[@]}" -m "not gpu" tests/kernels --junitxml="$DEST/kernel_tests.xml"
elif [ "$CPU" = 0 ] && [ "$QUICK" = 1 ]; then
    step gpu_tests 210 "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}" --junitxml="$DEST/gpu_tests.xml"
    step kernels 85 python bench/kernels.py --dtype fp16 --out "$DEST"
    step e2e 150 python bench/gpu_e2e.py --out "$DEST" --budget-s 120
elif [ "$CPU" = 0 ]; then
    step gpu_tests 210 "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}" --junitxml="$DEST/gpu_tests.xml"
    step kernels 150 python bench/kernels.py --out "$DEST"
    step e2e 150 python bench/gpu_e2e.py --out "$DEST" --budget-s 110
    LEFT=$(( 470 - ($(date +%s) - START) ))
    if [ "$LEFT" -gt 20 ]; then  # the sweep writes as it goes, the target's shape first (whole: --rest)
        step sweep "$(( LEFT < 110 ? LEFT : 110 ))" python bench/kernels.py --sweep-only --out "$DEST"
    fi
else
    export TRITON_INTERPRET=1
    step gpu_tests 300 "${PYTEST[@]}" -m "not bench" tests/kernels/test_cuda_attention.py --junitxml="$DEST/gpu_tests.xml"
    step kernels 300 python bench/kernels.py --device cpu --out "$DEST"
    step e2e 300 python bench/gpu_e2e.py --device cpu --out "$DEST" --prompt-tokens 32 --new-tokens 8 --batch 1,2 --budget-s 120
    step sweep 300 python bench/kernels.py --device cpu --sweep-only --out "$DEST"
fi
step report 60 python bench/gpu_report.py "$DEST"
echo "gpu_check.sh: $DEST/BENCHMARKS.md ($(( $(date +%s) - START ))s)"
exit $FAILED
