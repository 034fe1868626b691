#!/usr/bin/env bash
# One call on the GPU machine: install, run the GPU tests, run the benchmark; logs and JSON to $OUT.
# Usage (device tool): bash scripts/gpu_check.sh [tests|probe|bench|all|package]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
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
exit $rc
