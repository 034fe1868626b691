#!/usr/bin/env bash
# One call on the GPU machine: install, run the GPU tests, run the benchmark; logs and JSON to $OUT.
# Usage (device tool): bash scripts/gpu_check.sh [tests|probe|bench|all|package|duo|compare|kernels|fuzz|memcheck|verify]
# compare (two GPUs): GPU 0 runs `pytest -m "gpu and not slow"`; GPU 1 benches llama-1b tscompile-triton
# on each source tree named in COMPARE_TREES ("name=dir ...", e.g. trees unpacked by `git archive` into
# a carried folder; "head=." is this checkout), back to back, then `pytest -m "gpu and slow"` while time
# is left. Each tree is installed into its own folder and run from /tmp, so trees never mix.
# Compile caches (scripts/gpu_cache.sh): GPU_CACHE_IN=.gpu_cache restores them first, GPU_CACHE_OUT=1 saves
# them into $OUT at the end unless GPU_CACHE_SAVE_BEFORE (default 580) seconds of the call are within
# 20 s (shorten the mode's own *_SECONDS to leave it room). Cold-start figures need empty caches.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# SKIP_INSTALL=1: a second mode started beside a first in the same call (one install, no race)
[ "${SKIP_INSTALL:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if [ -n "${GPU_CACHE_IN:-}" ] || [ "${GPU_CACHE_OUT:-0}" = 1 ]; then
  eval "$(bash scripts/gpu_cache.sh restore "${GPU_CACHE_IN:-}")"
fi
rc=0
if [ "$what" = package ]; then
  bash scripts/package_diag.sh 2>&1 | tee "$OUT/package_diag.log" | tail -60
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 540 python3 -m pytest -q -m gpu tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = probe ] || [ "$what" = all ]; then
  # decode ms/step with the graph-alone time and a host-phase breakdown
  timeout 300 python3 scripts/decode_probe.py ${PROBE_MODEL:-llama-1b} 1,32 2>&1 | grep -v -i warn | tee "$OUT/probe.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # the committed bench/results figures; a big model's baselines compile for minutes: add modes per call
  tscompile bench ${BENCH_ARGS:---model llama-1b --batch-size 1 32 --input-len 512 --output-len 128 \
    --prefill-lens 32 2048 --modes tscompile-triton --num-iters 2 --num-iters-warmup 1} \
    --output-json "$OUT/bench.json" --output-md "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
if [ "$what" = duo ]; then
  # two GPUs (nvidia-h200-x2): the GPU tests on GPU 0 while GPU 1 runs bench jobs one after another
  # (DUO_JOBS="model:mode model:mode ..."); each job its own JSON/markdown, packed into one archive
  deadline=$((SECONDS + ${DUO_SECONDS:-540}))
  mkdir -p "$OUT/r"
  if [ "${DUO_TESTS:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout $((deadline - SECONDS)) python3 -m pytest -q -m gpu tests ${PYTEST_ARGS:-} \
      > "$OUT/gpu_tests.log" 2>&1 &
    tests_pid=$!
  fi
  (
    export CUDA_VISIBLE_DEVICES=${DUO_BENCH_GPU:-1}
    for job in ${DUO_JOBS:-llama-1b:tscompile-triton}; do
      model=${job%%:*}; mode=${job#*:}; left=$((deadline - SECONDS))
      [ $left -lt 60 ] && { echo "skipped $job: ${left}s left"; continue; }
      echo "== $job (${left}s left)"
      timeout $left tscompile bench --model "$model" --modes "$mode" --batch-size 1 32 --input-len 512 \
        --output-len 128 --prefill-lens 32 2048 --num-iters 2 --num-iters-warmup 1 \
        --output-json "$OUT/r/${model}_${mode}.json" --output-md "$OUT/r/${model}_${mode}.md" 2>&1 | tail -25
    done
  ) > "$OUT/bench.log" 2>&1 &
  bench_pid=$!
  [ -n "${tests_pid:-}" ] && { wait $tests_pid; rc=$?; tail -30 "$OUT/gpu_tests.log"; }
  wait $bench_pid
  cat "$OUT/bench.log"
  tar czf "$OUT/bench_results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
fi
if [ "$what" = kernels ]; then
  # kernel tables of prefill steps per source tree of COMPARE_TREES (one GPU, trees one after another)
  for tree in ${COMPARE_TREES:-head=.}; do
    name=${tree%%=*}; src=$(cd "${tree#*=}" && pwd)
    python3 -m pip install -q --no-deps --no-build-isolation --target "/tmp/site_$name" "$src" > "$OUT/install_$name.log" 2>&1 \
      || { echo "install of $name failed"; continue; }
    echo "== tree $name"
    (cd /tmp && PYTHONPATH="/tmp/site_$name" timeout ${KERNELS_SECONDS:-200} python3 "$OLDPWD/scripts/prefill_kernels.py" \
      "$OUT/kernels_$name.json" 2>&1 | grep -v -i warn | tee "$OUT/kernels_$name.log")
  done
fi
if [ "$what" = compare ]; then
  deadline=$((SECONDS + ${COMPARE_SECONDS:-560}))
  mkdir -p "$OUT/r"
  export TSCOMPILE_REPORT_DIR="$OUT/r"
  bench_gpu=1
  if [ "${COMPARE_TESTS:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout $((deadline - SECONDS)) python3 -m pytest -q -m "gpu and not slow" tests \
      ${PYTEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1 &
    tests_pid=$!
  else
    bench_gpu=0  # one GPU, nothing else running: the benches have an idle machine
  fi
  launch='import sys; sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
from tscompile.cli import main; sys.argv[0] = "tscompile"; sys.exit(main())'
  (
    export CUDA_VISIBLE_DEVICES=$bench_gpu
    for tree in ${COMPARE_TREES:-head=.}; do
      name=${tree%%=*}; src=$(cd "${tree#*=}" && pwd); left=$((deadline - SECONDS))
      [ $left -lt 90 ] && { echo "skipped $name: ${left}s left"; continue; }
      echo "== $name ($src, ${left}s left)"
      python3 -m pip install -q --no-deps --no-build-isolation --target "/tmp/site_$name" "$src" \
        > "$OUT/r/install_$name.log" 2>&1 || { echo "install of $name failed"; tail -5 "$OUT/r/install_$name.log"; continue; }
      (cd /tmp && PYTHONPATH="/tmp/site_$name" timeout $left python3 -c "$launch" bench --model llama-1b \
        --modes tscompile-triton --batch-size 1 32 --input-len 512 --output-len 128 --prefill-lens 32 2048 \
        --num-iters ${COMPARE_ITERS:-5} --num-iters-warmup 1 --output-json "$OUT/r/bench_$name.json" \
        --output-md "$OUT/r/bench_$name.md" 2>&1 | tail -20)
    done
    left=$((deadline - SECONDS))
    if [ $left -gt 120 ]; then
      echo "== pytest -m 'gpu and slow' (${left}s left)"
      timeout $left python3 -m pytest -q -s -m "gpu and slow" tests 2>&1 | tail -15
    fi
    left=$((deadline - SECONDS))
    if [ "${CHECKPOINT_BENCH:-0}" = 1 ] && [ $left -gt 150 ]; then
      echo "== bench --model <llama-1b written by transformers> (${left}s left)"
      python3 scripts/write_checkpoint.py llama-1b /tmp/ckpt_llama1b && timeout $((deadline - SECONDS)) \
        tscompile bench --model /tmp/ckpt_llama1b --modes tscompile-triton --batch-size 1 32 --input-len 512 \
        --output-len 128 --prefill-lens 32 2048 --num-iters 2 --num-iters-warmup 1 \
        --output-json "$OUT/r/bench_checkpoint.json" --output-md "$OUT/r/bench_checkpoint.md" 2>&1 | tail -20
    fi
  ) > "$OUT/bench.log" 2>&1 &
  bench_pid=$!
  if [ -n "${tests_pid:-}" ]; then wait $tests_pid; rc=$?; tail -30 "$OUT/gpu_tests.log"; fi
  wait $bench_pid
  cat "$OUT/bench.log"
  for f in "$OUT"/r/bench_*.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
fi
if [ "$what" = fuzz ]; then
  # the engine fuzz on compiled engines: batched vs one at a time, graph replay vs the same padded step
  # without graphs (scripts/fuzz_gpu.py; FUZZ_ARGS e.g. "--count 1000 --max-seconds 420 --bf16")
  timeout ${FUZZ_SECONDS:-560} python3 scripts/fuzz_gpu.py "$OUT/fuzz.json" ${FUZZ_ARGS:-} > "$OUT/fuzz.log" 2>&1
  rc=$?
  grep -v -i warn "$OUT/fuzz.log" | tail -80
fi
if [ "$what" = memcheck ]; then
  # a subset of the Triton kernels' device tests under compute-sanitizer memcheck (scripts/memcheck.sh)
  bash scripts/memcheck.sh "$OUT/memcheck.log" 2>&1 | tail -30
  rc=${PIPESTATUS[0]}
  grep -E "Invalid|ERROR SUMMARY|Program hit" "$OUT/memcheck.log" | sort | uniq -c | sort -rn | head -20
fi
if [ "$what" = verify ]; then
  # two GPUs (nvidia-h200-x2), one call for everything that needs a GPU's proof. GPU 0 runs the test
  # files of VERIFY_TESTS0, GPU 1 those of VERIFY_TESTS1 (FlashInfer's too when its wheels were carried
  # in .whl/) and then the side jobs of VERIFY_SIDE: the export load check with this machine's own
  # CXX, the fuzz and the memcheck subset. SIGINT at the deadline so pytest still prints its summary.
  deadline=$((SECONDS + ${VERIFY_SECONDS:-560}))
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  # an empty VERIFY_TESTS0 leaves GPU 0 free (e.g. for an idle bench started beside this mode)
  tests0=${VERIFY_TESTS0-"tests/test_gpu_graphs.py tests/test_memory_and_faults.py tests/test_gpu_checkpoints.py"}
  tests1=${VERIFY_TESTS1-"tests/test_triton_backend.py tests/test_flashinfer.py"}
  [ -n "$tests0" ] && CUDA_VISIBLE_DEVICES=0 timeout -s INT $((deadline - SECONDS)) python3 -m pytest -v --tb=short -rfE \
    --durations=12 -m gpu $tests0 ${PYTEST_ARGS:-} > "$OUT/gpu_tests0.log" 2>&1 &
  tests_pid=$!
  [ -n "$tests0" ] || tests_pid=
  (
    export CUDA_VISIBLE_DEVICES=1
    if [ -n "$tests1" ]; then
      timeout -s INT $((deadline - SECONDS - ${VERIFY_SIDE_RESERVE:-150})) python3 -m pytest -v --tb=short -rfE \
        --durations=12 -m gpu $tests1 ${PYTEST_ARGS:-} > "$OUT/gpu_tests1.log" 2>&1
      echo "tests1 rc=$?"
    fi
    for job in ${VERIFY_SIDE:-export fuzz memcheck}; do
      left=$((deadline - SECONDS - 10))
      [ $left -lt 40 ] && { echo "== $job skipped: ${left}s left"; continue; }
      case $job in
        export)
          echo "== export with CXX=${CXX:-<unset>} (${left}s left)"
          timeout 240 tscompile export --model llama-tiny --out "$OUT/tiny-cuda.pt2" --device cuda --max-num-seqs 4 \
            --max-model-len 64 2>&1 | tail -8
          timeout 60 tscompile run-package "$OUT/tiny-cuda.pt2" --prompt-ids 1,15,27,3 --max-new-tokens 8 2>&1 | tail -3
          rm -f "$OUT"/tiny-cuda.* ;;
        fuzz)
          [ $left -gt ${VERIFY_FUZZ_SECONDS:-100000} ] && left=$VERIFY_FUZZ_SECONDS  # leave memcheck its time
          echo "== fuzz (${left}s)"
          timeout $left python3 scripts/fuzz_gpu.py "$OUT/fuzz.json" --max-seconds $((left - 30)) ${FUZZ_ARGS:-} \
            > "$OUT/fuzz.log" 2>&1; echo "fuzz rc=$?"; tail -5 "$OUT/fuzz.log" ;;
        memcheck)
          echo "== memcheck (${left}s left)"
          MEMCHECK_SECONDS=$((left - 60)) bash scripts/memcheck.sh "$OUT/memcheck.log" 2>&1 | tail -8 ;;
      esac
    done
  ) > "$OUT/side.log" 2>&1 &
  side_pid=$!
  [ -n "$tests_pid" ] && { wait $tests_pid; rc=$?; }
  wait $side_pid
  for f in "$OUT/gpu_tests0.log" "$OUT/gpu_tests1.log"; do
    [ -f "$f" ] && { echo "== $f"; grep -E "FAILED|ERROR|passed|failed" "$f" | tail -25; }
  done
  cat "$OUT/side.log"
fi
if [ "${GPU_CACHE_OUT:-0}" = 1 ]; then
  left=$((${GPU_CACHE_SAVE_BEFORE:-580} - SECONDS))
  if [ $left -lt 20 ]; then echo "gpu_cache: save skipped: ${left}s left"
  else timeout $left bash scripts/gpu_cache.sh save "$OUT" "${GPU_CACHE_PARTS:-3}" 2>&1; fi
fi
exit $rc
