"""The launch configuration each of a mode's Triton kernels runs with, where Inductor chose it at run time.

Inductor benchmarks some kernels' candidate configurations at their first launch (pointwise and
reduction kernels given several candidates, and coordinate-descent tuning where a mode turns it on)
and keeps the fastest. The choice is in neither the kernel's source nor its name, and two compiles of
the same graph can choose differently: on the H200 one query-RoPE kernel of tscompile's decode graph
took 1.9 us per layer in one run and 4.2 in another of the same lease (bench/results/llama-8b-008212b/),
and the tuned baseline's bs=1 reductions differed between leases (bench/results/llama-8b-fdfb5a4/).
Recording every such kernel's candidates and choice per mode lets two runs be compared kernel by
kernel instead of guessed at.

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


def describe(kernel, graph: str) -> dict | None:
    """One kernel's record, or None when nothing was chosen at run time (one candidate and no
    coordinate descent). Inductor's ``autotune_cache_info`` says how the choice was made: "miss"
    (benchmarked here among ``num_configs`` candidates, or tuned by coordinate descent), "hit" (a
    choice an earlier compile stored in the autotune cache); ``chosen`` is None until the kernel's
    first launch."""
    info = dict(getattr(kernel, "autotune_cache_info", None) or {})
    meta = getattr(kernel, "inductor_meta", None) or {}
    coordesc = bool(meta.get("coordinate_descent_tuning"))
    state = info.get("autotune_cache_state")
    candidates = len(getattr(kernel, "configs", None) or []) or None  # None once compiled
    if state not in ("hit", "miss") and not coordesc and not (candidates and candidates > 1):
        return None
    launchers = getattr(kernel, "launchers", None) or []
    chosen = _config_dict(launchers[0].config) if len(launchers) == 1 and hasattr(launchers[0], "config") else None
    fn = getattr(kernel, "fn", None)
    return {
        "kernel": getattr(fn, "__name__", None) or meta.get("kernel_name") or "?",
        "graph": graph,
        "cache": state,
        "num_configs": info.get("num_configs", candidates),
        "chosen": chosen,
        "coordinate_descent": coordesc,
        "size_hints": dict(getattr(kernel, "size_hints", None) or {}) or None,
    }


def collect(since: int) -> dict:
    """The run-time-chosen kernels of the Inductor modules loaded after ``snapshot()`` returned
    ``since``: ``{"kernels": [...], "graphs": n}`` plus ``"error"`` when Inductor's internals could
    not be read, ``"truncated"`` past ``MAX_KERNELS``."""
    try:
        modules = list(_code_cache().modules)[since:]
        autotuner = _autotuner_class()
    except Exception as e:  # noqa: BLE001
        return {"kernels": [], "graphs": 0, "error": f"{type(e).__name__}: {e}"}
    kernels: list[dict] = []
    for module in modules:
        graph = os.path.basename(getattr(module, "__file__", "") or "?")
        for obj in list(vars(module).values()):
            if isinstance(obj, autotuner) and (record := describe(obj, graph)) is not None:
                kernels.append(record)
    out: dict = {"kernels": kernels[:MAX_KERNELS], "graphs": len(modules)}
    if len(kernels) > MAX_KERNELS:
        out["truncated"] = len(kernels)
    return out
