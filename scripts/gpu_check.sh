#!/usr/bin/env bash
# The GPU check: install this checkout on a CUDA machine, then run one job, its log under $OUT.
#
#   bash scripts/gpu_check.sh tests                    the GPU tests (pytest -m gpu) in two parts, one after
#                                                      the other (or one per call, on a time-limited machine):
#   bash scripts/gpu_check.sh tests-shared [ARGS...]     those that share the device, over 3 pytest-xdist
#                                                      workers (one when pytest-xdist is missing)
#   bash scripts/gpu_check.sh tests-alone [ARGS...]      the gpu_alone tests (large models, or the device's
#                                                      free memory), one at a time
#                                                    ARGS narrow a part: test files or -k expressions.
#                                                    Each failure's report goes to $OUT/gpu_failures.txt as
#                                                    it happens, every test's duration to the log.
#   bash scripts/gpu_check.sh bench [BENCH ARGS...]    tscompile bench with these arguments (default: the
#                                                      llama-1b run of the README), JSON and markdown in $OUT
#   bash scripts/gpu_check.sh fuzz [FUZZ ARGS...]      scripts/fuzz_gpu.py, e.g. --count 1000 --bf16
#
# The exit status is the job's. The machine's GPU, driver and versions go to $OUT/gpu.txt.
set -uo pipefail
job=${1:-tests}
[ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/gpu.txt"
case $job in
  tests)
    bash "$0" tests-shared; rc_shared=$?
    bash "$0" tests-alone; rc=$?
    [ "$rc_shared" -ne 0 ] && rc=$rc_shared ;;
  tests-shared)
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 3 --dist loadfile)
    python3 -m pytest -v -rfE -m "gpu and not gpu_alone" "${workers[@]}" --durations=0 \
      --failure-log "$OUT/gpu_failures.txt" "$@" 2>&1 | tee "$OUT/gpu_tests_shared.log" | tail -40
    rc=${PIPESTATUS[0]} ;;
  tests-alone)
    python3 -m pytest -v -rfE -m "gpu and gpu_alone" --durations=0 \
      --failure-log "$OUT/gpu_failures.txt" "$@" 2>&1 | tee "$OUT/gpu_tests_alone.log" | tail -40
    rc=${PIPESTATUS[0]} ;;
  bench)
    [ $# -gt 0 ] || set -- --model llama-1b --batch-size 1 32 --input-len 512 --output-len 128 --prefill-lens 32 2048
    tscompile bench "$@" --output-dir "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
    rc=${PIPESTATUS[0]} ;;
  fuzz)
    python3 scripts/fuzz_gpu.py "$OUT/fuzz.json" "$@" > "$OUT/fuzz.log" 2>&1
    rc=$?
    tail -40 "$OUT/fuzz.log" ;;
  *)
    echo "usage: bash scripts/gpu_check.sh tests|tests-shared|tests-alone|bench|fuzz [ARGS...]" >&2
    rc=2 ;;
esac
exit "$rc"
