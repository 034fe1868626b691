#!/usr/bin/env bash
# The GPU check: install this checkout on a CUDA machine, then run one job, its log under $OUT.
#
#   bash scripts/gpu_check.sh tests [PYTEST ARGS...]   the GPU tests (pytest -m gpu); a shard: pass test
#                                                      files or -k expressions, e.g. tests/test_gpu_graphs.py
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
    python3 -m pytest -q -rfE -m gpu "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
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
    echo "usage: bash scripts/gpu_check.sh tests|bench|fuzz [ARGS...]" >&2
    rc=2 ;;
esac
exit "$rc"
