#!/usr/bin/env bash
# The Triton kernels' GPU tests under compute-sanitizer's memcheck (24 tests, MEMCHECK_SELECT overrides
# the -k expression): extend (with a prefix, page sizes 1/16/64, a long query over several row blocks,
# strided q/k/v views), decode (one and many KV splits, padded rows, NaN/inf in unwritten slots), the
# KV write and the decode metadata refresh, at the small shapes of tests/test_triton_backend.py.
# First a control: a Triton kernel that stores past the end of its tensor must be reported, or a clean
# result would prove nothing about Triton kernels.
# Usage: bash scripts/memcheck.sh [LOG] (default $OUT/memcheck.log); MEMCHECK_SECONDS bounds the test run.
set -uo pipefail
OUT=${OUT:-/tmp/out}
log=${1:-$OUT/memcheck.log}
mkdir -p "$(dirname "$log")"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$sanitizer" ] || { echo "memcheck: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"; exit 2; }
# every tensor its own cudaMalloc: inside a cached block an out-of-bounds access hits memory the
# allocator owns and memcheck cannot see it
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SELECT=${MEMCHECK_SELECT:-"extend_with_prefix or long_query or decode_matches_torch_and_pads or all_rows_padded \
or unwritten_slots or strided_qkv or kv_write_touches or refresh_through_the_op or gpu_refresh_matches_torch_at_scale"}
summary() {  # the sanitizer's lines "========= ERROR SUMMARY: N errors" (one per run), added up
  grep -h "ERROR SUMMARY" "$1" | awk '{n += $(NF-1); k++} END {if (k) printf "ERROR SUMMARY: %d errors (%d summary lines)", n, k}'
}

control=$(mktemp --suffix=.py)
cat > "$control" <<'EOF'
import torch, triton, triton.language as tl

@triton.jit
def store_past_the_end(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + n + 4096 + offs, offs.to(tl.float32))  # no mask: every store is out of bounds

out = torch.zeros(1000, device="cuda")
store_past_the_end[(1,)](out, out.numel(), BLOCK=128)
torch.cuda.synchronize()
print("control kernel ran")
EOF
echo "== control: an out-of-bounds Triton store ($sanitizer)" | tee "$log"
timeout 300 "$sanitizer" --tool memcheck --target-processes all python3 "$control" > "$log.control" 2>&1
control_line=$(summary "$log.control")
cat "$log.control" >> "$log"
echo "control: ${control_line:-no ERROR SUMMARY line} (expected: errors > 0)" | tee -a "$log"
control_rc=0
if ! echo "$control_line" | grep -qE "ERROR SUMMARY: [1-9]"; then
  echo "memcheck: the control's out-of-bounds store was NOT reported: a clean run below proves nothing" | tee -a "$log"
  control_rc=3
fi
rm -f "$control"

echo "== tests under memcheck: -k \"$SELECT\"" | tee -a "$log"
start=$SECONDS
timeout "${MEMCHECK_SECONDS:-420}" "$sanitizer" --tool memcheck --target-processes all --error-exitcode 86 \
  python3 -m pytest -q -p no:cacheprovider tests/test_triton_backend.py -k "$SELECT" > "$log.tests" 2>&1
rc=$?
cat "$log.tests" >> "$log"
tests_line=$(summary "$log.tests")
echo "memcheck: rc=$rc in $((SECONDS - start)) s (86: memcheck found errors, 124: timed out); \
pytest: $(grep -E "[0-9]+ (passed|failed)" "$log.tests" | tail -1); ${tests_line:-no ERROR SUMMARY line}" | tee -a "$log"
rm -f "$log.control" "$log.tests"
[ $rc -eq 0 ] && rc=$control_rc
exit $rc
