#!/usr/bin/env bash
# Two lanes of jobs on nvidia-h200-x2, one per GPU, each job run in turn until the call's deadline.
#   LANE0="compare pkgtests" LANE1="tests:custom_ops tests:prefill prefill_modes" bash scripts/gpu_lanes.sh
# Jobs (each writes under $OUT; pytest jobs append to $OUT/lane<N>_tests.log, with SIGINT at the
# deadline so pytest still prints its summary):
#   compare        llama-1b tscompile-triton, base tree .gpu_trees/base vs this tree (gpu_check.sh compare)
#   fibench[:M]    FlashInfer's cold and warm start (scripts/flashinfer_start.py, its JIT cache kept),
#                  then the bench of M (llama-1b), tscompile-triton next to tscompile-flashinfer, bs 1 8 32
#                  64, prefill 32 and 2048, with kernel tables (FlashInfer's libraries already built)
#   bench:M:MODES[@BS,BS][~NAME]  the bench of M, MODES comma-separated (e.g. compile-reduce-overhead,compile-reduce-overhead-tuned),
#                  bs 1 8 32 64 (BENCH_BS="1 32" or @1,32 for others; ~NAME: options from BENCH_OPTIONS_NAME), prefill 32 and 2048 (BENCH_PREFILL_LENS="32 128 512 2048"
#                  for others), 5 iterations,
#                  kernel tables -> $OUT/bench_M_MODES.{json,md}
#                  BENCH_RESUME=1: rows an earlier call of the same warm machine measured (kept in .bench_live/)
#                  are skipped, the rest written as ..._rN files (merge them with bench --merge); runs
#                  of an earlier lease: put their JSON in .bench_seed/ under .bench_live/'s names and
#                  carry .bench_seed (never .bench_live: a carried path replaces the device's copy).
#                  A row counts as done only when every mode of the job measured it, so a job of
#                  several modes cut inside its second mode measures everything again: for a run
#                  that may span calls, give each mode its own job (bench:M:A bench:M:B ...)
#   prewarm:M:MODES  every mode of MODES (comma-separated) benched once, 1 iteration, no warm-up, no
#                  kernel table (the tscompile modes first, one at a time: the engine takes 0.9 of the
#                  device; then the stock modes at once, one process each), to fill the compile caches (FX graph, AOTAutograd, the
#                  coordinate-descent `.best_config`s) that the timed bench:M:MODE jobs after it then
#                  load: a one-machine table of every mode fits fewer calls. The tuned baseline's
#                  coordinate-descent tuning runs beside the other stock modes' compiles and short runs,
#                  tscompile's bs=1 tuning alone (PREWARM_SERIAL=1: every mode alone, slower); the timed
#                  figures come only from the bench jobs, whose compile times are then warm ones.
#                  Its rows are discarded; its logs go to $OUT/prewarm_M_MODE.log. With BENCH_RESUME=1
#                  a mode whose prewarm finished in an earlier call of the warm machine is not repeated. The sequence
#                  that gave llama-1b's one-machine table (bench/results/same-lease-6be9ade/README.md):
#                  GPU_CACHE_OUT=1 with the prewarm alone, then at once (the machine stays warm ~30 s)
#                  GPU_CACHE_IN=.gpu_cache with every mode's bench job, so a lost machine costs no compile.
#   startup:M[:S]  scripts/startup.py for M: cold, warm and package start; S: starts to skip (a,b); the
#                  exported package is kept as /tmp/pkg_M.pt2
#   startup-tuned:M[:S]  the same with --decode-tuning on (what the bs=1 graph's tuning costs a start)
#                  (STARTUP_ARGS: more startup.py flags, STARTUP_TAG: a suffix of its file names; for bench
#                  jobs BENCH_OPTIONS, the tscompile modes' compile options as JSON, and BENCH_TAG)
#   pkgbench:M     tscompile bench of that package (package mode) beside tscompile-triton
#   pkgbench-graphs:M  the same with the package's decode in CUDA graphs (--package-cuda-graphs)
#   py:PATH[:A,B]  python3 PATH A B, its output in $OUT/<name>.log (e.g. py:scripts/decode_attn_sweep.py:--budget-s,200,
#                  which writes decode_attn_sweep.{json,md} into $OUT too; py:scripts/decode_graph_code.py:8,32)
#   extend_sweep   old vs dense extend kernels, their launch grids, llama-1b/8b shapes (scripts/extend_sweep.py)
#   unverified     the GPU tests of code changed since its last GPU run (tests_for unverified)
#   hfbench[:PART][@MODEL]  a transformers MODEL (default llama-1b) under eager / stock torch.compile /
#                  tscompile (bench --hf-model), PART forward or generate (default both); forward lengths
#                  HF_LENS (default "32 128 512 2048", the engine bench's prefill rows), modes HF_MODES
#                  (default all; e.g. "compile-reduce-overhead tscompile")
#   prefill_modes  piecewise vs whole-step prefill graphs (scripts/prefill_modes.py)
#   tests:NAME     one of the pytest selections in tests_for() below
#   env:VAR=VALUE  export VAR for the lane's later jobs (TSCOMPILE_DECODE_WRITE_IN_SPLIT=0: the three-kernel decode; TSCOMPILE_EXTEND_CONFIG=128:128,64,8,3:
#                  another extend tile for head_dim 128)
# FlashInfer's wheels are installed from .whl/ when carried.
# Compile caches (scripts/gpu_cache.sh; its header has the lead's call sequence): GPU_CACHE_IN=.gpu_cache
# (a carried folder of gpucache-NNofMM.tar.xz parts) restores Inductor's and Triton's caches before the
# jobs; GPU_CACHE_OUT=1 saves them into $OUT after the jobs, in at most GPU_CACHE_PARTS (default 3) of
# the 8 returned files, keeping GPU_CACHE_SAVE_SECONDS (default 25) of LANES_SECONDS for it (skipped
# with less than 20 s left). Compile and start-up figures of such a call are warm ones; a job that
# measures cold start must set its own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (as
# scripts/startup.py does).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
end=$((SECONDS + ${LANES_SECONDS:-570}))
deadline=$end
[ "${GPU_CACHE_OUT:-0}" = 1 ] && deadline=$((end - ${GPU_CACHE_SAVE_SECONDS:-25}))
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${GPU_CACHE_IN:-}" ] || [ "${GPU_CACHE_OUT:-0}" = 1 ]; then
  eval "$(bash scripts/gpu_cache.sh restore "${GPU_CACHE_IN:-}")"
elif [ "${BENCH_RESUME:-0}" = 1 ]; then
  # a resumed job recompiles from the caches its cut-short run left on this (still warm) machine
  export TORCHINDUCTOR_CACHE_DIR=$PWD/.live_cache/inductor TRITON_CACHE_DIR=$PWD/.live_cache/triton
fi
# Runs of an earlier lease to resume from travel as carry=[".bench_seed"] (JSON named as .bench_live/
# names them; a bench job reads both folders). Never carry .bench_live itself: a carried path
# replaces the device's copy, so the rows an earlier call of the same warm machine left there would
# be lost (it happened: a cut eager run was measured again from its first row).

tests_for() {
  case $1 in
    custom_ops) echo "tests/test_custom_ops.py" ;;
    prefill) echo "tests/test_gpu_graphs.py -k prefill_graph" ;;
    flashinfer_new) echo "tests/test_flashinfer.py -k 64_or_first_use_or_llama_1b" ;;
    flashinfer_rest) echo "tests/test_flashinfer.py -k first_use_or_llama_1b" ;;
    flashinfer) echo "tests/test_flashinfer.py" ;;
    user_compile) echo "tests/test_user_compile_gpu.py tests/test_bench_hf_model.py" ;;
    packages) echo "tests/test_gpu_packages.py" ;;
    pkg_graphs) echo "tests/test_gpu_packages.py -k cuda_graphs" ;;
    pkg_new) echo "tests/test_gpu_packages.py -k cuda_graphs_or_checkpoint" ;;
    ladder) echo "tests/test_gpu_graphs.py -k ladder_without_1" ;;
    gpu_packages_ext) echo "tests/test_gpu_packages.py -k external_weights_or_bf16" ;;
    extend_fast) echo "tests/test_triton_extend_fast.py" ;;
    unverified) echo "tests/test_gpu_graphs.py tests/test_triton_backend.py -k tuned_decode_graph_or_bs1_decode_runs_its_matmuls_or_decode_gemv_pass_or_few_splits" ;;  # the tuned decode graph's policy (DECODE_TUNED_MATMULS), TSCOMPILE_DECODE_BS1_SPLITS
    merge_check) echo "tests/test_gpu_graphs.py tests/test_prefill_startup_capture.py -k prefill_graph_or_startup_capture_or_start_up_capture_or_compiled_graphs_equal_or_triton_equals_torch_or_replay_equals_eager" ;;
    final) echo "tests/test_triton_extend_fast.py tests/test_gpu_graphs.py -k gpu_new_kernel_or_gpu_float32_or_bs1_decode_or_whole-triton_or_llama-tiny-whole" ;;
    hostwork) echo "tests/test_gpu_graphs.py tests/test_prefill_startup_capture.py -k whole-triton_or_llama-tiny-whole_or_async_scheduling_or_compiled_graphs_equal_or_bs1_decode_or_padded_rows_write_or_start_up_capture" ;;
    fused) echo "tests/test_triton_decode_write.py tests/test_prefill_step_ops.py tests/test_triton_extend_fast.py tests/test_host_fast_paths.py" ;;
    session7) echo "tests/test_gpu_graphs.py -k ladder_without_1_or_padded_rows_write_or_compiled_graphs_equal_or_synchronous_steps[triton]_or_triton_equals_torch_on_llama_1b_or_null_page_with_a_poisoned_pool[whole-triton]" ;;
    session8) echo "tests/test_triton_backend.py tests/test_triton_decode_write.py" ;;
    session9) echo "tests/test_triton_backend.py tests/test_triton_decode_write.py -k two_warp_or_gpu_decode_matches_torch" ;;
    session10) echo "tests/test_triton_backend.py tests/test_triton_decode_write.py -k two_warp_or_gpu_decode_matches_torch_or_write_in_split" ;;
    session11) echo "tests/test_triton_decode_write.py tests/test_triton_extend_fast.py -k self_writing_or_write_in_split_or_two_warp_or_gpu_float32" ;;
    session12) echo "tests/test_triton_decode_write.py tests/test_gpu_graphs.py tests/test_gpu_packages.py -k self_writing_or_triton_equals_torch_on_llama_1b_ragged_greedy_or_compiled_graphs_equal_or_cuda_graphs_decode_gives_or_narrowing_package_tokens" ;;  # the replay test fixed at 3753dab, the RoPE tables (083bb8d) through graphs and packages
    session13) echo "tests/test_triton_gemv.py tests/test_gpu_graphs.py -k torch_gpu_or_new_x_gpu_or_decode_gemv_pass_or_prefill_gemv_pass" ;;  # the gemv "acc" mode, 32-row "dot" tiles, the decode and prefill GEMV passes
    session15) echo "tests/test_triton_gemv.py tests/test_gpu_graphs.py -k fused_norm_and_residual_llama_8b_or_decode_gemv_pass_or_triton_equals_torch_on_llama_1b_ragged_greedy" ;;  # the fused GEMV (TSCOMPILE_DECODE_GEMV_FUSE), the default decode GEMV table on the H200
    session16) echo "tests/test_triton_gemv.py tests/test_gpu_graphs.py -k pdl" ;;  # TSCOMPILE_GEMV_PDL: the kernel after a writer in a graph, the engine's tokens
    session19) echo "tests/test_triton_backend.py tests/test_gpu_graphs.py -k two_warp_launches_or_triton_equals_torch_on_llama_1b_ragged_greedy" ;;  # head_dim 64 decode at 2 warps from 64 programs (llama-1b bs >= 8)
    session20) echo "tests/test_bench_kernel_table.py -k kernel_table_on_cuda_or_cuda_kernel_times" ;;  # the device busy time and step span of the kernel tables
    session23) echo "tests/test_triton_gemv.py -k dot_sum" ;;  # "dot_sum" (split-K summed by the last program) against the two-kernel split
    session27) echo "tests/test_triton_decode_write.py" ;;  # the write-in-split decode's GPU tests after the fused decode's removal (head shapes, large-batch launches, graph replay, PDL)
    session26) echo "tests/test_triton_decode_write.py -k replays_in_a_cuda_graph" ;;  # the write-in-split decode replayed in a CUDA graph against the three-kernel path
    session25) echo "tests/test_triton_decode_write.py tests/test_triton_backend.py -k large_batch_launches_or_each_measured_geometry_or_three_kernel_path_on_gpu_or_pdl_in_a_graph" ;;  # the head_dim-128 decode geometry (2 warps from 256 programs, one split of 64-key tiles at 4 warps from 512): oracle and bits
    session24) echo "tests/test_triton_gemv.py tests/test_gpu_graphs.py -k sums_equal_or_dot_sum_or_batch_gemv_or_triton_equals_torch_on_llama_1b_ragged_greedy" ;;  # the "_sum" modes, the few-row swap as the default
    session23_engine) echo "tests/test_gpu_graphs.py -k batch_gemv" ;;  # the few-row swap in the decode batch graphs, "dot_sum" included
    session21) echo "tests/test_gpu_graphs.py -k whole-triton_or_async_scheduling_or_padded_rows_write" ;;  # abea5c1 (allocator slices) and d6f6777 (idle schedule, extend metadata reuse, one copy event per whole-step bucket) through whole-step graphs
    session18) echo "tests/test_gpu_graphs.py tests/test_triton_extend_fast.py -k batch_gemv_or_prefill_gemv_pass_or_decode_gemv_pass_or_prefill_pdl" ;;  # TSCOMPILE_BATCH_GEMV (the few-row swap in the decode batch graphs, with and without PDL), TSCOMPILE_PREFILL_PDL (extend kernel and prefill pieces)
    session17) echo "tests/test_triton_gemv.py tests/test_gpu_graphs.py tests/test_triton_extend_fast.py tests/test_triton_decode_write.py -k pdl_or_llama8b_or_float32_fits_or_triton_equals_torch_on_llama_1b_ragged_greedy" ;;  # PDL on by default (GEMV), TSCOMPILE_DECODE_PDL (attention), head_dim 128 long-prompt extend tile
    triton_graphs) echo "tests/test_gpu_graphs.py -k triton_equals_torch_on_llama_1b_ragged_greedy" ;;  # with env: flags
    all) echo "tests" ;;
    *) echo "tests/test_$1.py" ;;
  esac
}

run_job() {  # lane job
  local lane=$1 job=$2 left=$((deadline - SECONDS - 5))
  [ $left -lt 30 ] && { echo "== $job skipped: ${left}s left"; return; }
  echo "== $job (${left}s left, $(date +%T))"
  case $job in
    env:*=*)  # env:VAR=VALUE exports VAR for the lane's later jobs (e.g. env:TSCOMPILE_DECODE_PDL=0)
      # (the lists BENCH_BS and BENCH_PREFILL_LENS take commas for spaces: env:BENCH_PREFILL_LENS=32,2048)
      # (locals named so that no job's variable can be one of them: export would set the local)
      local _env_pair=${job#env:}; local _env_var=${_env_pair%%=*} _env_val=${_env_pair#*=}
      case $_env_var in BENCH_BS|BENCH_PREFILL_LENS|HF_LENS|HF_MODES) _env_val=${_env_val//,/ } ;; esac
      export "$_env_var=$_env_val"; echo "exported $_env_var=$_env_val"; return ;;
    compare)
      OUT=/tmp/compare SKIP_INSTALL=1 GPU_CACHE_IN= GPU_CACHE_OUT=0 COMPARE_TESTS=0 COMPARE_SECONDS=$left COMPARE_TREES="base=.gpu_trees/base head=." \
        bash scripts/gpu_check.sh compare > /tmp/compare.out 2>&1
      grep -A40 "== /tmp/compare/r/bench_" /tmp/compare.out | grep -E "^== |^\| tscompile" ; cp /tmp/compare/results.tgz "$OUT/compare.tgz" ;;
    fibench|fibench:*)
      local model=${job#fibench}; model=${model#:}; model=${model:-llama-1b}
      export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_$model  # the cold start fills it; the bench finds it warm
      rm -rf "$FLASHINFER_WORKSPACE_BASE"
      if [ "${FIBENCH_START:-1}" = 1 ]; then  # FIBENCH_START=0: the bench's FlashInfer setup builds cold
        timeout $left python3 scripts/flashinfer_start.py --model $model --dtype bfloat16 \
          --cache-dir "$FLASHINFER_WORKSPACE_BASE" > "$OUT/flashinfer_start_$model.json" 2> "$OUT/flashinfer_start_$model.log"
        echo "flashinfer_start rc=$?"; tail -c 1500 "$OUT/flashinfer_start_$model.json"
      fi
      left=$((deadline - SECONDS - 5))
      timeout $left tscompile bench --model $model --modes tscompile-triton tscompile-flashinfer \
        --batch-size 1 8 32 64 --input-len 512 --output-len 128 --prefill-lens 32 2048 --num-iters 5 \
        --num-iters-warmup 1 --kernel-table --output-json "$OUT/fibench_$model.json" --output-md "$OUT/fibench_$model.md" \
        --no-progress 2>&1 | tail -40 ;;
    bench:*)
      # bench:M:MODES[@BS,BS][~NAME]: @ sets this job's batch sizes (else BENCH_BS), ~NAME its tscompile
      # compile options from the variable BENCH_OPTIONS_NAME (else BENCH_OPTIONS) and adds _NAME to its files
      local spec=${job#bench:} opt_name="" bs=${BENCH_BS:-1 8 32 64}
      case $spec in *~*) opt_name=${spec##*~}; spec=${spec%~*} ;; esac
      case $spec in *@*) bs=${spec##*@}; bs=${bs//,/ }; spec=${spec%@*} ;; esac
      local model=${spec%%:*} modes=${spec#*:}; local tag=${modes//,/_}${BENCH_TAG:-}${opt_name:+_$opt_name}
      local options=${BENCH_OPTIONS:-}
      if [ -n "$opt_name" ]; then local var=BENCH_OPTIONS_$opt_name; options=${!var:-}
        [ -z "$options" ] && { echo "== $job: $var is empty"; return; }; fi
      local lens=${BENCH_PREFILL_LENS:-32 2048} skip="" file=bench_${model}_$tag
      if [ "${BENCH_RESUME:-0}" = 1 ]; then
        # a job an earlier call of this warm machine cut short measures only its missing rows
        # (its runs are kept in .bench_live/, which the device keeps between calls as an ignored folder)
        mkdir -p .bench_live; local runs=() f n=1
        for f in .bench_seed/${file}.json .bench_seed/${file}_r*.json .bench_live/${file}.json .bench_live/${file}_r*.json; do
          [ -f "$f" ] && runs+=("$f"); done
        skip=$(python3 scripts/bench_resume.py --modes ${modes//,/ } --batch-size $bs --prefill-lens $lens --runs "${runs[@]}")
        [ "$skip" = DONE ] && { echo "== $job: every row measured in ${runs[*]}"; return; }
        if [ ${#runs[@]} -gt 0 ]; then  # the next _rN no run in either folder has
          while [ -f .bench_live/${file}_r$n.json ] || [ -f .bench_seed/${file}_r$n.json ] || [ $n = 1 ]; do n=$((n + 1)); done
          file=${file}_r$n; echo "== resumed as $file: $skip"
        fi
      fi
      # the tscompile modes' compile options as one JSON argument (spaces allowed)
      timeout $left tscompile bench --model $model --modes ${modes//,/ } --batch-size $bs --input-len 512 \
        --output-len 128 --prefill-lens $lens $skip --num-iters 5 --num-iters-warmup 1 --kernel-table \
        ${options:+--tscompile-options "$options"} \
        --output-json "$OUT/$file.json" --output-md "$OUT/$file.md" --no-progress \
        2> "$OUT/$file.log"; echo "rc=$?"; sed -n '/### Decode/,/### Kernels/p' "$OUT/$file.md"
      [ "${BENCH_RESUME:-0}" = 1 ] && [ -f "$OUT/$file.json" ] && cp "$OUT/$file.json" .bench_live/ ;;
    prewarm:*)
      # tscompile's engine takes gpu_memory_utilization (0.9) of the whole device for itself, so beside
      # three other 8B processes it found no room for its KV pool (H200, 2026-12-03): the engine modes
      # prewarm first, one at a time on the idle device, then the stock modes together. A mode whose
      # prewarm finished in an earlier call of the warm machine (BENCH_RESUME=1) is not repeated.
      local spec=${job#prewarm:}; local model=${spec%%:*} modes=${spec#*:} m rc=0 pid
      local engine_modes=() stock_modes=() pids=()
      for m in ${modes//,/ }; do
        case $m in tscompile*) engine_modes+=("$m") ;; *) stock_modes+=("$m") ;; esac
      done
      mkdir -p .bench_live
      prewarm_one() {  # one mode's untimed bench; a marker in .bench_live when it finished
        local m=$1 marker=.bench_live/prewarm_${model}_$1.done
        [ "${BENCH_RESUME:-0}" = 1 ] && [ -f "$marker" ] && { echo "== prewarm $model $m: done in an earlier call"; return 0; }
        local left=$((deadline - SECONDS - 5)); [ $left -lt 30 ] && { echo "== prewarm $model $m skipped: ${left}s left"; return 1; }
        timeout $left tscompile bench --model $model --modes $m --batch-size ${BENCH_BS:-1 8 32 64} --input-len 512 \
          --output-len 128 --prefill-lens ${BENCH_PREFILL_LENS:-32 2048} --num-iters 1 --num-iters-warmup 0 \
          --output-json /tmp/prewarm_${model}_$m.json --output-md /tmp/prewarm_${model}_$m.md --no-progress \
          > "$OUT/prewarm_${model}_$m.log" 2>&1
        local r=$? why=""
        # an error row (the bench exits 0 after one) means the caches were not filled either
        [ $r = 0 ] && grep -q '"error": "' /tmp/prewarm_${model}_$m.json && { r=1; why=", an error row (its log)"; }
        echo "== prewarm $model $m: rc=$r$why ($(date +%T))"
        [ $r = 0 ] && touch "$marker"; return $r
      }
      for m in "${engine_modes[@]}"; do prewarm_one "$m" || rc=1; done
      if [ "${PREWARM_SERIAL:-0}" = 1 ]; then  # every mode alone: each party's tuning on an idle device
        for m in "${stock_modes[@]}"; do prewarm_one "$m" || rc=1; done
      else
        for m in "${stock_modes[@]}"; do prewarm_one "$m" & pids+=($!); done
      fi
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
      echo "rc=$rc ($(date +%T))" ;;
    startup:*|startup-tuned:*)  # startup-tuned: the same with the bs=1 decode graph's tuning
      local spec=${job#*:}; local model=${spec%%:*} skip="" tag="" extra=""
      [ "$spec" != "$model" ] && skip=${spec#*:}
      case $job in startup-tuned:*) tag=_tuned; extra="--decode-tuning on" ;; esac
      tag=$tag${STARTUP_TAG:-}; extra="$extra ${STARTUP_ARGS:-}"  # e.g. STARTUP_ARGS="--decode-ladder 2 4 8"
      timeout $left python3 scripts/startup.py --model $model ${skip:+--skip ${skip//,/ }} --keep-package /tmp/pkg_$model.pt2 \
        $extra --output-json "$OUT/startup_$model$tag.json" --output-md "$OUT/startup_$model$tag.md" 2> "$OUT/startup_$model$tag.log"
      echo "rc=$?"; head -8 "$OUT/startup_$model$tag.md" ;;
    pkgbench:*|pkgbench-graphs:*)  # the package startup:M kept, beside the engine; -graphs: its decode graphed
      local model=${job#*:} extra="" tag=""
      case $job in pkgbench-graphs:*) extra="--package-cuda-graphs"; tag=_graphs ;; esac
      timeout $left tscompile bench --model $model --modes tscompile-triton package --package /tmp/pkg_$model.pt2 $extra \
        --batch-size 1 8 32 64 --input-len 512 --output-len 128 --prefill-lens 32 512 --num-iters 5 --num-iters-warmup 1 \
        --output-json "$OUT/pkgbench_$model$tag.json" --output-md "$OUT/pkgbench_$model$tag.md" --no-progress \
        2> "$OUT/pkgbench_$model$tag.log"; echo "rc=$?"; cat "$OUT/pkgbench_$model$tag.md" ;;
    py:*)  # py:scripts/NAME.py[:ARG,ARG]: its output in $OUT/NAME.log (commas in ARGS become spaces)
      local script=${job#py:} args=""; case $script in *:*) args=${script#*:}; args=${args//,/ }; script=${script%%:*} ;; esac
      local name; name=$(basename "$script" .py)
      timeout $left python3 "$script" $args > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v -i warn "$OUT/$name.log" | tail -30 ;;
    hfbench|hfbench:*|hfbench@*)
      local spec=${job#hfbench} hf_model=llama-1b
      case $spec in *@*) hf_model=${spec#*@}; spec=${spec%%@*} ;; esac
      local parts=${spec#:}; parts=${parts:-forward generate}; local tag=${hf_model}_${parts// /_}
      timeout $left tscompile bench --hf-model "$hf_model" --device cuda --dtype bfloat16 \
        --hf-lens ${HF_LENS:-32 128 512 2048} ${HF_MODES:+--hf-modes $HF_MODES} \
        --hf-generate-tokens 32 --num-iters 5 --hf-parts $parts --no-progress --verbose \
        --output-json "$OUT/hfbench_$tag.json" --output-md "$OUT/hfbench_$tag.md" \
        2> "$OUT/hfbench_$tag.log"; echo "rc=$?"; cat "$OUT/hfbench_$tag.md" ;;
    extend_sweep)
      timeout $left python3 scripts/extend_sweep.py "$OUT/extend_sweep.json" 2>&1 | grep -v -i warn | tail -40 ;;
    prefill_modes)
      timeout $left python3 scripts/prefill_modes.py "$OUT/prefill_modes.json" --iters 10 2>&1 | grep -v -i warn | tail -14 ;;
    tests:*)
      local sel; sel=$(tests_for "${job#tests:}")
      local files=${sel%% -k *} k=""
      [ "$files" != "$sel" ] && k=${sel#* -k }
      timeout -s INT $left python3 -m pytest -v --tb=short -rfE --durations=8 -m gpu $files ${k:+-k "${k//_or_/ or }"} \
        >> "$OUT/lane${lane}_tests.log" 2>&1
      echo "rc=$?"; grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/lane${lane}_tests.log" | tail -12 ;;
    *) echo "unknown job $job" ;;
  esac
}

lane() {
  export CUDA_VISIBLE_DEVICES=$1
  for job in $2; do run_job "$1" "$job"; done
}

lane 0 "${LANE0:-compare}" > "$OUT/lane0.log" 2>&1 &
pid0=$!
pid1=
if [ -n "${LANE1-tests:custom_ops}" ]; then  # LANE1="" on a one-GPU machine
  lane 1 "${LANE1-tests:custom_ops}" > "$OUT/lane1.log" 2>&1 &
  pid1=$!
fi
wait $pid0 $pid1
[ -s "$OUT/install.log" ] || rm -f "$OUT/install.log"
# At most 8 files come back from a call (a call of three benches and a sweep lost its test log to
# that limit): when the lane logs, the compile-cache parts saved below and the rest would pass it,
# everything but the lane logs goes into one archive
shopt -s nullglob
others=()
lane_logs=0
for f in "$OUT"/*; do
  case $(basename "$f") in lane*.log) lane_logs=$((lane_logs + 1)) ;; results.tgz|gpucache-*) ;; *) others+=("$f") ;; esac
done
cache_parts=0
[ "${GPU_CACHE_OUT:-0}" = 1 ] && cache_parts=${GPU_CACHE_PARTS:-3}
if [ ${#others[@]} -gt $((8 - lane_logs - cache_parts)) ]; then
  tar -czf "$OUT/results.tgz" -C "$OUT" "${others[@]##*/}" && rm -f "${others[@]}"
  echo "######## $OUT: ${#others[@]} result files packed into results.tgz"
fi
for n in 0 1; do [ -f "$OUT/lane$n.log" ] && { echo "######## lane $n"; cat "$OUT/lane$n.log"; }; done
if [ "${GPU_CACHE_OUT:-0}" = 1 ]; then
  left=$((end - SECONDS))
  if [ $left -lt 20 ]; then echo "gpu_cache: save skipped: ${left}s left"
  else timeout $left bash scripts/gpu_cache.sh save "$OUT" "${GPU_CACHE_PARTS:-3}" 2>&1; fi
fi
