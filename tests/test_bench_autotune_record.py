"""bench/autotune_record.py: each Triton kernel of a mode's graphs, the launch configuration it runs with
and how Inductor chose it, read from real ``CachingAutotuner`` objects in the graph modules Inductor
loaded after a snapshot (built here without compiling: the CPU has no Triton codegen)."""

from __future__ import annotations

import types

import pytest
import triton

from bench import autotune_record

CachingAutotuner = pytest.importorskip("torch._inductor.runtime.triton_heuristics").CachingAutotuner
PyCodeCache = pytest.importorskip("torch._inductor.codecache").PyCodeCache


def _kernel(name: str, info: dict, *, launched: triton.Config | None = None, coordesc: bool = False,
            configs=None):
    kernel = CachingAutotuner.__new__(CachingAutotuner)  # the real class, its __init__ needs a GPU kernel
    kernel.fn = types.SimpleNamespace(__name__=name)
    kernel.autotune_cache_info = info
    kernel.inductor_meta = {"coordinate_descent_tuning": True} if coordesc else {}
    kernel.configs = configs
    kernel.launchers = [types.SimpleNamespace(config=launched)] if launched is not None else []
    kernel.size_hints = {"x": 4096}
    return kernel


def _module(path: str, graph: bool = True, **kernels) -> types.ModuleType:
    """An Inductor output module (with its ``call`` entry point), or with ``graph=False`` a kernel's
    own source module, which Inductor loads into the same list."""
    module = types.ModuleType("graph")
    module.__file__ = path
    if graph:
        module.call = lambda args: None
    for name, obj in kernels.items():
        setattr(module, name, obj)
    return module


def test_records_each_kernel_of_the_graph_modules_loaded_after_the_snapshot_once(monkeypatch):
    earlier = _module("/cache/ab/earlier.py", triton_poi_fused_0=_kernel(
        "triton_poi_fused_0", {"autotune_cache_state": "miss", "num_configs": 2}, launched=triton.Config({"XBLOCK": 64})))
    monkeypatch.setattr(PyCodeCache, "modules", [earlier])
    since = autotune_record.snapshot()
    assert since == 1
    rope = _kernel("triton_poi_fused_1", {"autotune_cache_state": "miss", "num_configs": 3},
                   launched=triton.Config({"XBLOCK": 256}, num_warps=4, num_stages=1))
    graph = _module(
        "/cache/cd/graph.py",
        triton_poi_fused_1=rope,
        triton_red_fused_2=_kernel("triton_red_fused_2", {"autotune_cache_state": "hit"}, coordesc=True,
                                   launched=triton.Config({"XBLOCK": 1, "R0_BLOCK": 2048}, num_warps=16, num_stages=1)),
        triton_poi_fused_3=_kernel("triton_poi_fused_3", {"autotune_cache_state": "only 1 config"},
                                   launched=triton.Config({"XBLOCK": 128})),
        triton_per_fused_4=_kernel("triton_per_fused_4", {"autotune_cache_state": "miss", "num_configs": 2}),
        not_a_kernel=object(),
    )
    # the same kernel object in a second graph module, and in the kernel's own source module
    other = _module("/cache/ef/other.py", triton_poi_fused_1=rope)
    source = _module("/cache/gh/kernel.py", graph=False, triton_poi_fused_1=rope,
                     reloaded=_kernel("triton_poi_fused_1", {"autotune_cache_state": "hit"}))
    PyCodeCache.modules.extend([graph, source, other])
    got = autotune_record.collect(since)
    assert got["graphs"] == 2 and "error" not in got
    names = [k["kernel"] for k in got["kernels"]]
    # every kernel of the two graph modules once; nothing from the earlier or the source module
    assert sorted(names) == ["triton_per_fused_4", "triton_poi_fused_1", "triton_poi_fused_3", "triton_red_fused_2"]
    by_name = {k["kernel"]: k for k in got["kernels"]}
    assert by_name["triton_poi_fused_1"] == {
        "kernel": "triton_poi_fused_1", "graph": "graph.py", "cache": "miss", "num_configs": 3,
        "chosen": {"XBLOCK": 256, "num_warps": 4, "num_stages": 1}, "coordinate_descent": False,
        "size_hints": {"x": 4096}}
    assert by_name["triton_red_fused_2"]["cache"] == "hit" and by_name["triton_red_fused_2"]["coordinate_descent"]
    assert by_name["triton_red_fused_2"]["chosen"] == {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16, "num_stages": 1}
    assert by_name["triton_poi_fused_3"]["cache"] == "only 1 config"
    assert by_name["triton_per_fused_4"]["chosen"] is None  # never launched: nothing chosen yet


def test_a_kernel_not_yet_launched_still_shows_its_candidates(monkeypatch):
    """Before its first launch a kernel still holds its candidates (``configs``), also where the
    autotune cache was off (no "hit"/"miss" state)."""
    kernel = _kernel("triton_poi_fused_5", {"autotune_cache_state": "force_disabled"},
                     configs=[triton.Config({"XBLOCK": 64}), triton.Config({"XBLOCK": 128})])
    monkeypatch.setattr(PyCodeCache, "modules", [_module("/c/g.py", k=kernel)])
    [record] = autotune_record.collect(0)["kernels"]
    assert record["num_configs"] == 2 and record["cache"] == "force_disabled" and record["chosen"] is None


def test_odd_attributes_give_an_error_entry_or_none_not_an_exception(monkeypatch):
    kernel = _kernel("triton_poi_fused_6", ["not", "a", "dict"], launched=triton.Config({"XBLOCK": 32}))
    kernel.size_hints = ["x"]
    monkeypatch.setattr(PyCodeCache, "modules", [_module("/c/g.py", k=kernel)])
    [record] = autotune_record.collect(0)["kernels"]
    assert record["cache"] is None and record["size_hints"] is None \
        and record["chosen"] == {"XBLOCK": 32, "num_warps": 4, "num_stages": 3}

    def broken(kernel, graph):
        raise KeyError("launchers")

    monkeypatch.setattr(autotune_record, "describe", broken)
    assert autotune_record.collect(0) == {"kernels": [], "graphs": 0, "error": "KeyError: 'launchers'"}


def test_unreadable_internals_give_an_error_entry_not_an_exception(monkeypatch):
    def broken():
        raise ImportError("moved")

    monkeypatch.setattr(autotune_record, "_code_cache", broken)
    assert autotune_record.snapshot() == 0
    assert autotune_record.collect(0) == {"kernels": [], "graphs": 0, "error": "ImportError: moved"}


def test_many_kernels_are_truncated_with_the_total_kept(monkeypatch):
    kernels = {f"k{i}": _kernel(f"k{i}", {"autotune_cache_state": "miss", "num_configs": 2}) for i in range(5)}
    monkeypatch.setattr(PyCodeCache, "modules", [_module("/c/g.py", **kernels)])
    monkeypatch.setattr(autotune_record, "MAX_KERNELS", 3)
    got = autotune_record.collect(0)
    assert len(got["kernels"]) == 3 and got["truncated"] == 5


def test_the_markdown_lists_each_modes_choices_and_only_when_there_are_some(monkeypatch):
    from bench import report

    modes = {
        "eager": {"autotuned_kernels": {"kernels": [], "graphs": 0}},
        "tscompile-triton": {"autotuned_kernels": {"graphs": 2, "kernels": [
            {"kernel": "triton_poi_fused_1", "graph": "g1.py", "cache": "miss", "num_configs": 3,
             "chosen": {"XBLOCK": 256, "num_warps": 4}, "coordinate_descent": False, "size_hints": {"x": 4096}},
            {"kernel": "triton_red_fused_2", "graph": "g2.py", "cache": "hit", "num_configs": None,
             "chosen": None, "coordinate_descent": True, "size_hints": None},
            {"kernel": "triton_poi_fused_3", "graph": "g2.py", "cache": "only 1 config", "num_configs": None,
             "chosen": {"XBLOCK": 128}, "coordinate_descent": False, "size_hints": None},
            {"kernel": "triton_poi_fused_4", "graph": "g2.py", "cache": None, "num_configs": None,
             "chosen": {"XBLOCK": 64}, "coordinate_descent": False, "size_hints": None},
        ]}},
        "one-config-only": {"autotuned_kernels": {"graphs": 1, "kernels": [
            {"kernel": "k", "graph": "g.py", "cache": "only 1 config", "chosen": {"XBLOCK": 8}}]}},
        "old-run": {},  # a JSON written before the record existed
    }
    text = "\n".join(report.autotune_markdown(modes))
    assert text.startswith("### Launch configurations chosen at run time")
    # the single-candidate kernels stay in the JSON only
    assert "**tscompile-triton**: 3 kernels" in text and "**eager**" not in text and "old-run" not in text
    assert "triton_poi_fused_3" not in text and "one-config-only" not in text
    assert "| g2.py | `triton_poi_fused_4` | autotune cache off | XBLOCK 64 |" in text
    assert "| g1.py | `triton_poi_fused_1` | benchmarked (3 candidates) | XBLOCK 256, num_warps 4 |" in text
    assert "| g2.py | `triton_red_fused_2` | coordinate descent, autotune cache hit | - (never launched) |" in text
    monkeypatch.setattr(report, "AUTOTUNE_ROWS_PER_MODE", 1)
    assert "3 kernels (2 more in the JSON)" in "\n".join(report.autotune_markdown(modes))
    assert report.autotune_markdown({"eager": modes["eager"], "old-run": {}}) == []
