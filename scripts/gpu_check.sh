#!/usr/bin/env bash
# The GPU check: install this checkout on a CUDA machine, then run one job, its log under $OUT.
#
#   bash scripts/gpu_check.sh tests                    the GPU tests (pytest -m gpu) in two parts, one after
#                                                      the other (or one per call, on a time-limited machine):
#   bash scripts/gpu_check.sh tests-shared [ARGS...]     those that share the device, over pytest-xdist
#                                                      workers (3, or --workers N; one when pytest-xdist is
#                                                      missing); a file's tests that share expensive
#                                                      fixtures stay on one worker (their xdist_group)
#   bash scripts/gpu_check.sh tests-alone [ARGS...]      the gpu_alone tests (large models, or the device's
#                                                      free memory), one at a time
#                                                    ARGS narrow a part: test files or -k expressions.
#                                                    Each failure's report goes to $OUT/gpu_failures.txt as
#                                                    it happens, every test's duration to the log, and each
#                                                    passed or skipped test's id to $OUT/gpu_done_PART.txt.
#                                                    `--resume FILE` (first, before ARGS): FILE is an earlier
#                                                    call's gpu_done_PART.txt; only the tests not in it run
#                                                    (a part that a machine's time limit cut short goes on).
#   bash scripts/gpu_check.sh bench [BENCH ARGS...]    tscompile bench with these arguments (default: the
#                                                      llama-1b run of the README), JSON and markdown in $OUT
#   bash scripts/gpu_check.sh fuzz [FUZZ ARGS...]      scripts/fuzz_gpu.py, e.g. --count 1000 --bf16
#   bash scripts/gpu_check.sh ab BEFORE_DIR [BENCH ARGS...]
#                                                    an A/B of a change: the same bench (default: llama-1b's
#                                                    engine, decode bs 1 and 32, prefill 32 and 2048, 20
#                                                    runs per point) from
#                                                    the source tree BEFORE_DIR (e.g. `git archive REV | tar
#                                                    -x -C DIR`), then from this checkout, back to back, and
#                                                    `tscompile bench --compare` of the two (exit 1 past 3%)
#   bash scripts/gpu_check.sh host-ab BEFORE_DIR [HOST PROFILE ARGS...]
#                                                    scripts/host_profile.py (default: llama-1b, a 32-token
#                                                    prompt) over the tree BEFORE_DIR, then this checkout:
#                                                    where each one's step host time goes, in
#                                                    $OUT/host_before and $OUT/host_after
#
# The exit status is the job's. The machine's GPU, driver and versions go to $OUT/gpu.txt.
# --workers N (before the job): the tests-shared part's pytest-xdist workers (default 3).
# --archive (before the job): when the job ends, everything it wrote under $OUT goes into one file,
# $OUT/gpu_check.tgz, and the loose files are removed (for a machine that sends back only a few files).
set -uo pipefail
archive=0
num_workers=3
while [ $# -gt 0 ]; do
  case $1 in
    --archive) archive=1; shift ;;
    --workers) num_workers=${2:?"--workers N"}; shift 2 ;;
    *) break ;;
  esac
done
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
# gpu_tests PART MARKERS [PYTEST ARGS...]: one part of the GPU tests, its log $OUT/gpu_tests_PART.log
gpu_tests() {
  local part=$1 markers=$2
  shift 2
  local done_log="$OUT/gpu_done_$part.txt"
  if [ "${1:-}" = "--resume" ]; then
    [ "${2:?"--resume FILE"}" -ef "$done_log" ] || cp "$2" "$done_log" || return 1
    shift 2
  else
    rm -f "$done_log"  # a run without --resume runs every test, whatever an earlier run left in $OUT
  fi
  # --done-log=PATH in one argument: pytest takes an existing path given apart for a test path when
  # it picks the root directory, which would rename the ids the file holds
  python3 -m pytest -v -rfE -m "$markers" --durations=0 --failure-log="$OUT/gpu_failures.txt" \
    --done-log="$done_log" "$@" 2>&1 \
    | tee "$OUT/gpu_tests_$part.log" | tail -40
  return "${PIPESTATUS[0]}"
}
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "$num_workers" --dist loadgroup)
case $job in
  tests)
    gpu_tests shared "gpu and not gpu_alone" "${workers[@]}"; rc_shared=$?
    gpu_tests alone "gpu and gpu_alone"; rc=$?
    [ "$rc_shared" -ne 0 ] && rc=$rc_shared ;;
  tests-shared)
    gpu_tests shared "gpu and not gpu_alone" "$@" "${workers[@]}"; rc=$? ;;
  tests-alone)
    gpu_tests alone "gpu and gpu_alone" "$@"; rc=$? ;;
  bench)
    [ $# -gt 0 ] || set -- --model llama-1b --batch-size 1 32 --input-len 512 --output-len 128 --prefill-lens 32 2048
    tscompile bench "$@" --output-dir "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
    rc=${PIPESTATUS[0]} ;;
  fuzz)
    python3 scripts/fuzz_gpu.py "$OUT/fuzz.json" "$@" > "$OUT/fuzz.log" 2>&1
    rc=$?
    tail -40 "$OUT/fuzz.log" ;;
  ab)
    before=${1:?"usage: bash scripts/gpu_check.sh ab BEFORE_DIR [BENCH ARGS...]"}
    shift
    # 20 runs per point: a prefill row is one step per run, and its median of 5 moved by 9% at 2048
    # tokens between two processes of the same code on an H200; the extra runs cost seconds beside
    # the compiles
    [ $# -gt 0 ] || set -- --model llama-1b --modes tscompile-triton --batch-size 1 32 --input-len 512 \
      --output-len 128 --prefill-lens 32 2048 --num-iters 20
    site=$(mktemp -d)  # the tree before, installed apart (not editable) and found first on the path
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$before" >> "$OUT/install.log" 2>&1 \
      || { tail -20 "$OUT/install.log"; exit 1; }
    (cd "$site" && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -m tscompile.cli bench "$@" \
      --output-json "$OUT/ab_before.json" --output-md "$OUT/ab_before.md") > "$OUT/ab_before.log" 2>&1
    tscompile bench "$@" --output-json "$OUT/ab_after.json" --output-md "$OUT/ab_after.md" > "$OUT/ab_after.log" 2>&1
    tscompile bench --compare "$OUT/ab_before.json" "$OUT/ab_after.json" --output-json "$OUT/ab_compare.json" \
      --output-md "$OUT/ab_compare.md" 2>&1 | tee "$OUT/ab_compare.log"
    rc=${PIPESTATUS[0]} ;;
  host-ab)
    before=${1:?"usage: bash scripts/gpu_check.sh host-ab BEFORE_DIR [HOST PROFILE ARGS...]"}
    shift
    [ $# -gt 0 ] || set -- --model llama-1b --prompt-len 32
    script=$(pwd)/scripts/host_profile.py
    site=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$before" >> "$OUT/install.log" 2>&1 \
      || { tail -20 "$OUT/install.log"; exit 1; }
    (cd "$site" && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 "$script" "$@" --out "$OUT/host_before") \
      2>&1 | tee "$OUT/host_before.log" | tail -3
    rc_before=${PIPESTATUS[0]}
    python3 "$script" "$@" --out "$OUT/host_after" 2>&1 | tee "$OUT/host_after.log" | tail -3
    rc=${PIPESTATUS[0]}
    [ "$rc_before" -ne 0 ] && rc=$rc_before
    rm -rf "$site" ;;
  *)
    echo "usage: bash scripts/gpu_check.sh [--workers N] [--archive] tests|tests-shared|tests-alone|bench|fuzz|ab|host-ab [ARGS...]" >&2
    rc=2 ;;
esac
if [ "$archive" = 1 ]; then
  bundle=$(mktemp --suffix .tgz)
  tar -czf "$bundle" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$bundle" "$OUT/gpu_check.tgz"
fi
exit "$rc"
