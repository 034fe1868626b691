"""The launch configuration each of a mode's Triton kernels runs with, and how Inductor chose it.

Inductor benchmarks some kernels' candidate configurations at their first launch (pointwise and
reduction kernels given several candidates, and coordinate-descent tuning where a mode turns it on)
and keeps the fastest. The choice is in neither the kernel's source nor its name. On the H200 one
query-RoPE kernel of tscompile's decode graph took 1.9 us per layer in one run and 4.2 in another on
the same machine, and the tuned baseline's bs=1 reductions took different times on two machines;
neither run recorded the configurations, so whether the choice differed is not known.
Recording every kernel's configuration and how it was chosen, per mode, lets two runs be compared
kernel by kernel instead of guessed at.

Inductor loads each compiled graph as a Python module (``PyCodeCache.modules``, in load order), whose
globals hold its kernels as ``CachingAutotuner`` objects; after a kernel's first launch its one
remaining launcher carries the chosen ``triton.Config``. A snapshot of the module count before a mode
and a ``collect`` after it give that mode's graphs, FX-graph-cache hits included (they load a module
too). On the CPU Inductor writes C++ kernels, so the list is empty there.
"""

from __future__ import annotations

import os

# a mode's JSON keeps at most this many kernels (a 32-layer graph has a few dozen distinct ones)
MAX_KERNELS = 400


def _code_cache():
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache


def _autotuner_class():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return CachingAutotuner


def snapshot() -> int:
    """The number of Inductor modules loaded so far (``collect``'s starting point)."""
    try:
        return len(_code_cache().modules)
    except Exception:  # noqa: BLE001  (Inductor internals moved: record nothing rather than fail a bench)
        return 0


def _config_dict(config) -> dict:
    out = dict(getattr(config, "kwargs", {}) or {})
    for key in ("num_warps", "num_stages"):
        if getattr(config, key, None) is not None:
            out[key] = getattr(config, key)
    return out


def describe(kernel, graph: str) -> dict:
    """One kernel's record. ``cache`` is Inductor's ``autotune_cache_info`` state: "miss" (benchmarked
    here among ``num_configs`` candidates, or tuned by coordinate descent), "hit" (a choice an earlier
    compile stored in the autotune cache), "only 1 config" (nothing to choose), "force_disabled" or
    None (chosen here, if there were candidates, with the cache off: their number is then gone once
    the kernel has launched). ``chosen`` is None until the kernel's first launch."""
    info = getattr(kernel, "autotune_cache_info", None)
    info = dict(info) if isinstance(info, dict) else {}
    meta = getattr(kernel, "inductor_meta", None)
    meta = meta if isinstance(meta, dict) else {}
    candidates = len(getattr(kernel, "configs", None) or []) or None  # None once compiled
    launchers = getattr(kernel, "launchers", None) or []
    chosen = _config_dict(launchers[0].config) if len(launchers) == 1 and hasattr(launchers[0], "config") else None
    fn = getattr(kernel, "fn", None)
    hints = getattr(kernel, "size_hints", None)
    return {
        "kernel": getattr(fn, "__name__", None) or meta.get("kernel_name") or "?",
        "graph": graph,
        "cache": info.get("autotune_cache_state"),
        "num_configs": info.get("num_configs", candidates),
        "chosen": chosen,
        "coordinate_descent": bool(meta.get("coordinate_descent_tuning")),
        "size_hints": {str(k): v for k, v in hints.items()} if isinstance(hints, dict) else None,
    }


def collect(since: int) -> dict:
    """Every Triton kernel of the Inductor graph modules loaded after ``snapshot()`` returned
    ``since``: ``{"kernels": [...], "graphs": n}`` plus ``"error"`` when Inductor's internals could
    not be read, ``"truncated"`` past ``MAX_KERNELS``. A graph module is one with Inductor's ``call``
    entry point: kernels' own source files are loaded into the same list (a kernel compiled or
    reloaded in this process), and reading those would count a kernel twice or add copies that never
    launch. A kernel object two graph modules share is recorded once."""
    try:
        modules = [m for m in list(_code_cache().modules)[since:] if callable(getattr(m, "call", None))]
        autotuner = _autotuner_class()
        kernels: list[dict] = []
        seen: set[int] = set()
        for module in modules:
            graph = os.path.basename(getattr(module, "__file__", "") or "?")
            for obj in list(vars(module).values()):
                if isinstance(obj, autotuner) and id(obj) not in seen:
                    seen.add(id(obj))
                    kernels.append(describe(obj, graph))
    except Exception as e:  # noqa: BLE001  (a bench run must never fail on this record)
        return {"kernels": [], "graphs": 0, "error": f"{type(e).__name__}: {e}"}
    out: dict = {"kernels": kernels[:MAX_KERNELS], "graphs": len(modules)}
    if len(kernels) > MAX_KERNELS:
        out["truncated"] = len(kernels)
    return out
