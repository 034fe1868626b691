"""What each mode compiled: Dynamo's recompiles and graph breaks, Inductor's FX graph cache hits,
beside tscompile's own counters.

Dynamo's ``torch._dynamo.utils.counters`` (as read in torch 2.13) has a ``"graph_break"`` table (one
key per break reason, the count of frame compiles that hit it) and ``"stats"``/``"unique_graphs"``
(graphs compiled; ``"frames"``/``"ok"`` misses ``fullgraph=True`` compiles), but no ``"recompiles"``
key. A recompile is a compile of a frame that already had a cache entry whose guards failed: Dynamo
records it as the ``recompile_reason`` of that compile's ``CompilationMetrics`` (the reason
``TORCH_LOGS=recompiles`` prints), so recompiles are counted from those records.
Every figure is a difference between two snapshots: Dynamo's counters are process-wide and
``torch._dynamo.reset()`` does not clear them.
"""

from __future__ import annotations

import torch._dynamo.utils as dynamo_utils

from tscompile.counters import counters as tscompile_counters

# tscompile's counters that say what a mode compiled and captured (tscompile/counters.py)
TSCOMPILE_KEYS = ("graphs", "pieces_compiled", "breaks", "decode_captures", "prefill_captures")
# Inductor's FX graph cache, per compiled graph one of hit / miss / bypass (a bypass: a graph the cache
# cannot key, compiled every time). A bench on warm caches (scripts/gpu_lanes.sh prewarm) reports
# warm compile times; these say which graphs really came from the cache.
FX_CACHE_KEYS = {"fx_cache_hits": "fxgraph_cache_hit", "fx_cache_misses": "fxgraph_cache_miss",
                 "fx_cache_bypasses": "fxgraph_cache_bypass"}
# AOTAutograd's cache, per graph one of hit / miss / bypass: on a miss AOTAutograd traces the graph
# again even when Inductor's FX cache then hits (the CPU: a warm llama-1b tuned baseline spent 12.4 s
# in AOTAutograd with both FX graphs cache hits).
AOT_CACHE_KEYS = {"aot_cache_hits": "autograd_cache_hit", "aot_cache_misses": "autograd_cache_miss",
                  "aot_cache_bypasses": "autograd_cache_bypass"}
# compiles kept in Dynamo's record of compilation metrics (its default keeps the last 64)
METRICS_LIMIT = 100_000


# Where compile time went, from Dynamo's per-compile ``CompilationMetrics`` (fields as in torch 2.11 to
# 2.13; a field a version lacks counts as absent). The phases overlap as Dynamo attributes them and
# need not add up: a cold CPU run recorded more Inductor than AOTAutograd time (70.6 s against 2.4),
# a warm one AOTAutograd inside the frame's compile. Run-time records (``is_runtime``) carry the first-run autotuning and CUDA-graph
# recording that a mode pays on its first calls. Why: with every graph an FX cache hit, the tuned
# baseline still spent about 40 s per batch size in its warm-up runs (H200, llama-1b and llama-8b);
# these say where.
PHASE_FIELDS = {
    "frame_s": "dynamo_cumulative_compile_time_us",
    "aot_autograd_s": "aot_autograd_cumulative_compile_time_us",
    "inductor_s": "inductor_cumulative_compile_time_us",
    "triton_compile_s": "triton_compile_time_us",
    "compile_autotune_s": "compile_time_autotune_time_us",
    "runtime_autotune_s": "runtime_triton_autotune_time_us",
    "cudagraphify_s": "runtime_cudagraphify_time_us",
    "gc_s": "gc_time_us",
}


def _metrics() -> list:
    get = getattr(dynamo_utils, "get_compilation_metrics", None)
    return list(get()) if get is not None else []


def _recompile_records(records: list | None = None) -> list:
    return [m for m in (_metrics() if records is None else records) if getattr(m, "recompile_reason", None)]


def compile_phases(before: dict) -> dict[str, float]:
    """Seconds per ``PHASE_FIELDS`` phase, summed over the compiles (and run-time records) since
    ``before``; a phase no record measured is left out."""
    records = _metrics()[before.get("metrics_records", 0):]
    out: dict[str, float] = {}
    for key, field in PHASE_FIELDS.items():
        values = [v for v in (getattr(m, field, None) for m in records) if isinstance(v, (int, float))]
        if values:
            out[key] = sum(values) / 1e6
    return out


def keep_compilation_metrics() -> int | None:
    """Make room for every compile of a bench run in Dynamo's record; returns the old limit."""
    deque = getattr(dynamo_utils, "_compilation_metrics", None)
    setter = getattr(dynamo_utils, "set_compilation_metrics_limit", None)
    if deque is None or setter is None:
        return None
    old = deque.maxlen
    setter(METRICS_LIMIT)
    return old


def restore_compilation_metrics(old_limit: int | None) -> None:
    setter = getattr(dynamo_utils, "set_compilation_metrics_limit", None)
    if old_limit is not None and setter is not None:
        setter(old_limit)


def snapshot() -> dict:
    dyn, records = dynamo_utils.counters, _metrics()
    return {"graph_breaks": sum(dyn["graph_break"].values()), "graphs_compiled": dyn["stats"]["unique_graphs"],
            "recompile_records": len(_recompile_records(records)), "metrics_records": len(records),
            **{k: dyn["inductor"][name] for k, name in FX_CACHE_KEYS.items()},
            **{k: dyn["aot_autograd"][name] for k, name in AOT_CACHE_KEYS.items()},
            **{k: tscompile_counters[k] for k in TSCOMPILE_KEYS}}


def since(before: dict) -> dict:
    """Integers: ``recompiles``, ``graph_breaks``, ``graphs_compiled`` (Dynamo), ``FX_CACHE_KEYS``
    (Inductor), ``AOT_CACHE_KEYS`` (AOTAutograd) and ``TSCOMPILE_KEYS``."""
    now = snapshot()
    out = {"recompiles": now["recompile_records"] - before["recompile_records"]}
    out.update({k: now[k] - before[k] for k in now if k not in ("recompile_records", "metrics_records")})
    return out


def recompile_reasons(before: dict, limit: int = 5, width: int = 200) -> list[str]:
    """The first few recompile reasons since ``before`` (for the JSON: why a mode recompiled)."""
    records = _recompile_records()[before["recompile_records"]:]
    return [str(m.recompile_reason)[:width] for m in records[:limit]]

