#!/usr/bin/env bash
# Carry Inductor's and Triton's compile caches from one GPU call to the next (the machine forgets
# everything between calls, so without this every call recompiles every engine from scratch).
#
#   eval "$(bash scripts/gpu_cache.sh restore DIR)"   # unpack DIR's parts, print the export lines
#   bash scripts/gpu_cache.sh save OUTDIR [N]          # pack the caches into at most N parts (default 3)
#
# restore prints `export TORCHINDUCTOR_CACHE_DIR=...` and `export TRITON_CACHE_DIR=...` on stdout (a
# script cannot export into its caller, so the caller evals them; everything else goes to stderr).
# It always prints them, with or without archives in DIR (DIR may be missing: the first call), so a
# later `save` finds what this call compiled. Both point under one fixed root, GPU_CACHE_ROOT
# (default /tmp/gpucache): inductor/ holds Inductor's FX graph cache (fxgraph/), AOTAutograd's cache
# (aotautograd/), the generated kernels' sources and their `.best_config` autotune results
# (coordinate descent included); triton/ holds Triton's compiled kernels and launchers. The FX
# graph and AOTAutograd caches are on by default in torch 2.11 (and live under the Inductor dir),
# so no other variable is needed.
#
# save writes gpucache-01of03.tar.xz ... (one xz-compressed tar stream cut into parts, each below
# GPU_CACHE_PART_MIB, default 15 MiB, so N=3 leaves 5 of the device tool's 8 returned files to the
# rest), and at most GPU_CACHE_MAX_MIB (default 40) in all: the carried tree may hold 64 MiB, of which
# FlashInfer's wheels (.whl/) take 17 and the sources (this tree, .gpu_trees/) a few. When the whole
# does not fit it drops, in order, what is cheapest to regenerate:
#   1. Triton's intermediate IR (*.ttir *.ttgir *.llir *.ptx *.amdgcn *.source): a cache hit needs
#      only the binary (.cubin) and the metadata .json (Triton's own TRITON_STORE_BINARY_ONLY keeps
#      just these). The __grp__*.json index of each kernel is rewritten to list only what is kept:
#      Triton 3.6 skips missing members, but newer Tritons treat any missing member as a miss.
#   2. Triton's copies of Inductor-generated kernels (triton_poi_/per_/red_/tem_/for_*): the FX graph
#      cache bundles the ones each graph needs, and `.best_config` names the tuned config, so only the
#      tuned config recompiles (no coordinate-descent search). Hand-written kernels stay.
#   3. Triton's cache altogether (Inductor's dir alone).
# If even that does not fit it saves nothing and says so. Sizes are printed on stderr.
#
# The lead's sequence (the caches' folder stays out of git through the shared info/exclude, which the
# device tool honours too: an ignored folder travels only when named in `carry`):
#   once:        echo /.gpu_cache/ >> "$(git rev-parse --git-common-dir)/info/exclude"
#   first call:  GPU_CACHE_OUT=1 ... bash scripts/gpu_lanes.sh           (the parts come back in $OUT)
#   then:        rm -rf .gpu_cache && mkdir .gpu_cache && cp <returned>/gpucache-*of*.tar.xz .gpu_cache/
#   next calls:  carry [".gpu_cache", ...] and GPU_CACHE_IN=.gpu_cache GPU_CACHE_OUT=1 ... (refreshes it)
#
# Caveats:
# - Cache keys include the torch, Triton and CUDA versions, the GPU (Inductor: its name and properties;
#   Triton: its architecture) and the source of every compiled graph and kernel. Another machine kind,
#   another torch or a changed model simply misses (and recompiles); it never gives wrong kernels.
# - Not carried: FlashInfer's JIT-built libraries (FLASHINFER_WORKSPACE_BASE) and Dynamo's tracing,
#   which reruns every time (the caches save Inductor's and Triton's share of a compile).
# - Triton's index files name their members by absolute path: restore rewrites them when the root
#   differs from the one that saved them, so keep GPU_CACHE_ROOT fixed anyway (it costs nothing).
# - Entries of old code versions pile up from call to call; empty .gpu_cache now and then (or when
#   save starts dropping levels).
# - Cold-start measurements need empty caches: a job that measures cold start must point
#   TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at its own new empty folders (scripts/startup.py
#   does, for each of its measurements). Compile times and start-up figures reported by other jobs
#   in a call that restored caches are warm figures, not cold ones.
set -uo pipefail

ROOT=${GPU_CACHE_ROOT:-/tmp/gpucache}
PART_BYTES=${GPU_CACHE_PART_BYTES:-$(( ${GPU_CACHE_PART_MIB:-15} * 1048576 - 4096 ))}
IR_GLOBS=("*.ttir" "*.ttgir" "*.llir" "*.ptx" "*.amdgcn" "*.source")
INDUCTOR_KERNEL_RE='^triton_(poi|per|red|tem|for)_'
PART_RE='^gpucache-([0-9]{2})of([0-9]{2})\.tar\.xz$'

say() { echo "gpu_cache: $*" >&2; }
refuse() { echo "gpu_cache.sh: $*" >&2; exit 2; }
mib() { awk -v b="$1" 'BEGIN { if (b < 1048576) printf "%.0f KiB", b / 1024; else printf "%.1f MiB", b / 1048576 }'; }
bytes_of() { du -sb "$@" 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'; }

# xz -3: within 7% of -6's size on binaries at about 2.5 times its speed, and its 12 MiB blocks let
# -T0 spread a cache of a few hundred MiB over all cores, so save takes seconds (GPU_CACHE_XZ_LEVEL)
compress() {  # stdin -> stdout; xz's own threads when the binary is there, Python's lzma otherwise
  local level=${GPU_CACHE_XZ_LEVEL:-3}
  if command -v xz > /dev/null; then xz -T0 -"$level" -c
  else python3 -c $'import lzma, shutil, sys\nwith lzma.LZMAFile(sys.stdout.buffer, "w", preset=int(sys.argv[1])) as f: shutil.copyfileobj(sys.stdin.buffer, f)' "$level"
  fi
}
decompress() {
  if command -v xz > /dev/null; then xz -T0 -dc
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), sys.stdout.buffer)'
  fi
}

# Triton's __grp__<kernel>.json lists its members by absolute path. `prune TREE ROOT` keeps in each
# index only the members present under TREE (where ROOT's files were copied) and removes indexes
# whose metadata .json or binary is gone; `reroot TREE OLD` points the members of every index under
# TREE (which was saved from OLD) at TREE. Both write a new file, never through a hard link.
groups() {
  python3 - "$@" <<'EOF'
import json, os, sys
action, tree, other = sys.argv[1], os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3])
for dirpath, _, names in os.walk(tree):
    for name in names:
        if not (name.startswith("__grp__") and name.endswith(".json")):
            continue
        path = os.path.join(dirpath, name)
        try:
            with open(path) as f:
                members = json.load(f)["child_paths"]
        except (OSError, ValueError, KeyError, TypeError):
            os.remove(path)  # unreadable: Triton would miss on it anyway
            continue
        kept = {}
        for member, where in members.items():
            rel = os.path.relpath(where, other)
            if rel.startswith(".."):
                kept[member] = where  # outside the cache (never written by Triton): left alone
            elif action == "reroot" or os.path.exists(os.path.join(tree, rel)):
                kept[member] = os.path.join(tree if action == "reroot" else other, rel)
        has_binary = any(not m.endswith(".json") for m in kept)
        if not any(m.endswith(".json") for m in kept) or not has_binary:
            os.remove(path)
            continue
        tmp = path + ".rewrite"
        with open(tmp, "w") as f:
            json.dump({"child_paths": kept}, f)
        os.replace(tmp, path)
EOF
}

restore() {
  local dir=${1?usage: gpu_cache.sh restore DIR}  # "" or a missing folder: cold caches
  mkdir -p "$ROOT/inductor" "$ROOT/triton"
  local parts=() names=() count="" n=0 name
  if [ -d "$dir" ]; then
    while IFS= read -r name; do
      [[ $name =~ $PART_RE ]] || continue
      n=$((n + 1))
      count=${BASH_REMATCH[2]}
      [ "${BASH_REMATCH[1]}" = "$(printf %02d $n)" ] || { say "$dir: part $name out of order"; parts=(); break; }
      parts+=("$dir/$name")
    done < <(ls "$dir" | sort)
  fi
  if [ ${#parts[@]} -eq 0 ]; then
    say "no cache parts in ${dir:-<none>}: cold caches under $ROOT"
  elif [ "$((10#$count))" -ne ${#parts[@]} ]; then
    say "$dir holds ${#parts[@]} of $count parts: cold caches under $ROOT"
  else
    local start=$SECONDS
    if cat "${parts[@]}" | decompress | tar -x -C "$ROOT"; then
      local saved_root
      saved_root=$(cat "$ROOT/saved_root.txt" 2>/dev/null || echo "$ROOT")
      [ "$saved_root" != "$ROOT" ] && groups reroot "$ROOT/triton" "$saved_root/triton"
      say "restored ${#parts[@]} part(s), $(mib "$(cat "${parts[@]}" | wc -c)") packed, $(mib "$(bytes_of "$ROOT/inductor" "$ROOT/triton")") unpacked into $ROOT in $((SECONDS - start)) s"
    else
      say "unpacking $dir failed: cold caches under $ROOT (a half-unpacked file could be a corrupt hit)"
      rm -rf "${ROOT:?}/inductor" "${ROOT:?}/triton"
      mkdir -p "$ROOT/inductor" "$ROOT/triton"
    fi
  fi
  echo "export TORCHINDUCTOR_CACHE_DIR=$ROOT/inductor"
  echo "export TRITON_CACHE_DIR=$ROOT/triton"
}

drop_level() {  # tree level: remove what level N drops (cumulative)
  local tree=$1 level=$2
  if [ "$level" -ge 1 ]; then
    local args=() g
    for g in "${IR_GLOBS[@]}"; do args+=(-o -name "$g"); done
    find "$tree/triton" -type f \( "${args[@]:1}" \) -delete
  fi
  if [ "$level" -ge 2 ]; then
    find "$tree/triton" -type f -regextype posix-extended -regex ".*/${INDUCTOR_KERNEL_RE#^}.*" -printf '%h\n' \
      | sort -u | xargs -r rm -rf
  fi
  [ "$level" -ge 3 ] && rm -rf "$tree/triton" && mkdir -p "$tree/triton"
  [ "$level" -ge 1 ] && groups prune "$tree/triton" "$ROOT/triton"
  return 0
}

save() {
  local outdir=${1:?usage: gpu_cache.sh save OUTDIR [N]} max_parts=${2:-${GPU_CACHE_PARTS:-3}}
  [[ $max_parts =~ ^[0-9]+$ ]] && [ "$max_parts" -ge 1 ] && [ "$max_parts" -le 99 ] \
    || refuse "N (the most parts) must be a whole number from 1 to 99, got '$max_parts'"
  [[ $PART_BYTES =~ ^[0-9]+$ ]] && [ "$PART_BYTES" -ge 1024 ] \
    || refuse "GPU_CACHE_PART_BYTES must be a whole number of bytes >= 1024, got '$PART_BYTES'"
  mkdir -p "$outdir"
  rm -f "$outdir"/gpucache-*of*.tar.xz
  if [ ! -d "$ROOT/inductor" ] && [ ! -d "$ROOT/triton" ]; then say "nothing under $ROOT to save"; return 0; fi
  mkdir -p "$ROOT/inductor" "$ROOT/triton"
  [[ ${GPU_CACHE_MAX_MIB:-40} =~ ^[0-9]+$ ]] || refuse "GPU_CACHE_MAX_MIB must be a whole number of MiB, got '$GPU_CACHE_MAX_MIB'"
  local budget=$((max_parts * PART_BYTES)) start=$SECONDS
  [ $budget -gt $(( ${GPU_CACHE_MAX_MIB:-40} * 1048576 )) ] && budget=$(( ${GPU_CACHE_MAX_MIB:-40} * 1048576 ))
  local ir_bytes
  ir_bytes=$(find "$ROOT/triton" -type f \( -name "*.ttir" -o -name "*.ttgir" -o -name "*.llir" -o -name "*.ptx" \
    -o -name "*.amdgcn" -o -name "*.source" \) -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
  say "caches: inductor $(mib "$(bytes_of "$ROOT/inductor")") (fxgraph $(mib "$(bytes_of "$ROOT/inductor/fxgraph")"), aotautograd $(mib "$(bytes_of "$ROOT/inductor/aotautograd")")), triton $(mib "$(bytes_of "$ROOT/triton")") (IR $(mib "$ir_bytes")); budget $(mib "$budget") ($max_parts x $(mib "$PART_BYTES"), GPU_CACHE_MAX_MIB ${GPU_CACHE_MAX_MIB:-40})"
  local stage archive level fitted="" ratio=""
  stage=$(mktemp -d "$ROOT.stage.XXXXXX") || refuse "cannot make a staging folder beside $ROOT"
  archive=$stage/all.tar.xz
  local levels=("everything" "without Triton IR" "without Triton's copies of Inductor kernels" "Inductor's cache only")
  for level in 0 1 2 3; do
    rm -rf "$stage/tree" && mkdir -p "$stage/tree"
    # hard links: the staging copy costs no space and pruning it leaves the live caches alone
    cp -al "$ROOT/inductor" "$ROOT/triton" "$stage/tree/" 2> /dev/null || cp -a "$ROOT/inductor" "$ROOT/triton" "$stage/tree/"
    find "$stage/tree" -type f \( -name "*.tmp" -o -name "*.tmp.pid_*" -o -name "*.lock" -o -name lock \) -delete
    drop_level "$stage/tree" $level
    echo "$ROOT" > "$stage/tree/saved_root.txt"
    local raw size
    raw=$(bytes_of "$stage/tree")
    # what is left after a drop packs no better than what went before (IR text packs best), so the
    # last ratio is an optimistic guess: a level that misses the budget even by it is not worth packing
    # (not so for Inductor's dir alone, mostly text, so level 3 is always packed)
    if [ "$level" -le 2 ] && [ -n "$ratio" ] && awk -v r="$raw" -v q="$ratio" -v b="$budget" 'BEGIN { exit !(r * q > b) }'; then
      say "level $level (${levels[$level]}): $(mib "$raw"), would pack to about $(mib "$(awk -v r="$raw" -v q="$ratio" 'BEGIN { printf "%d", r * q }')"): skipped"
      continue
    fi
    tar -C "$stage/tree" -cf - inductor triton saved_root.txt | compress > "$archive"
    size=$(stat -c %s "$archive")
    ratio=$(awk -v s="$size" -v r="$raw" 'BEGIN { print (r > 0 ? s / r : 1) }')
    say "level $level (${levels[$level]}): $(mib "$raw") -> $(mib "$size") packed"
    if [ "$size" -le "$budget" ]; then fitted=$level; break; fi
  done
  if [ -z "$fitted" ]; then
    say "even Inductor's cache alone is over $(mib "$budget"): nothing saved"
    rm -rf "$stage"; return 1
  fi
  local count=$(( ($(stat -c %s "$archive") + PART_BYTES - 1) / PART_BYTES ))
  split -b "$PART_BYTES" -d -a 2 --numeric-suffixes=1 "$archive" "$stage/part"
  local i
  for ((i = 1; i <= count; i++)); do
    mv "$stage/part$(printf %02d $i)" "$outdir/gpucache-$(printf %02d $i)of$(printf %02d $count).tar.xz"
  done
  rm -rf "$stage"
  say "saved level $fitted in $((SECONDS - start)) s:"
  local part
  for part in "$outdir"/gpucache-*of*.tar.xz; do say "  $part $(mib "$(stat -c %s "$part")")"; done
}

case ${1:-} in
  restore) shift; restore "$@" ;;
  save) shift; save "$@" ;;
  *) refuse "the subcommand must be 'restore DIR' or 'save OUTDIR [N]', got '${1:-}'" ;;
esac
