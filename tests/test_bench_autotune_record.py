"""bench/autotune_record.py: which Triton kernels of a mode had their launch configuration chosen at
run time, and which one they run with, read from real ``CachingAutotuner`` objects in the modules
Inductor loaded after a snapshot (built here without compiling: the CPU has no Triton codegen)."""

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


def _module(path: str, **kernels) -> types.ModuleType:
    module = types.ModuleType("graph")
    module.__file__ = path
    for name, obj in kernels.items():
        setattr(module, name, obj)
    return module


def test_records_the_run_time_choices_of_the_modules_loaded_after_the_snapshot(monkeypatch):
    earlier = _module("/cache/ab/earlier.py", triton_poi_fused_0=_kernel(
        "triton_poi_fused_0", {"autotune_cache_state": "miss", "num_configs": 2}, launched=triton.Config({"XBLOCK": 64})))
    monkeypatch.setattr(PyCodeCache, "modules", [earlier])
    since = autotune_record.snapshot()
    assert since == 1
    graph = _module(
        "/cache/cd/graph.py",
        triton_poi_fused_1=_kernel("triton_poi_fused_1", {"autotune_cache_state": "miss", "num_configs": 3},
                                   launched=triton.Config({"XBLOCK": 256}, num_warps=4, num_stages=1)),
        triton_red_fused_2=_kernel("triton_red_fused_2", {"autotune_cache_state": "hit"}, coordesc=True,
                                   launched=triton.Config({"XBLOCK": 1, "R0_BLOCK": 2048}, num_warps=16, num_stages=1)),
        triton_poi_fused_3=_kernel("triton_poi_fused_3", {"autotune_cache_state": "only 1 config"},
                                   launched=triton.Config({"XBLOCK": 128})),
        triton_per_fused_4=_kernel("triton_per_fused_4", {"autotune_cache_state": "miss", "num_configs": 2}),
        not_a_kernel=object(),
    )
    PyCodeCache.modules.append(graph)
    got = autotune_record.collect(since)
    assert got["graphs"] == 1 and "error" not in got
    by_name = {k["kernel"]: k for k in got["kernels"]}
    # the single-candidate kernel and the earlier module's kernel are left out
    assert sorted(by_name) == ["triton_per_fused_4", "triton_poi_fused_1", "triton_red_fused_2"]
    assert by_name["triton_poi_fused_1"] == {
        "kernel": "triton_poi_fused_1", "graph": "graph.py", "cache": "miss", "num_configs": 3,
        "chosen": {"XBLOCK": 256, "num_warps": 4, "num_stages": 1}, "coordinate_descent": False,
        "size_hints": {"x": 4096}}
    assert by_name["triton_red_fused_2"]["cache"] == "hit" and by_name["triton_red_fused_2"]["coordinate_descent"]
    assert by_name["triton_red_fused_2"]["chosen"] == {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16, "num_stages": 1}
    assert by_name["triton_per_fused_4"]["chosen"] is None  # never launched: nothing chosen yet


def test_a_kernel_with_candidates_but_no_cache_info_still_counts(monkeypatch):
    """Before its first launch a kernel still holds its candidates (``configs``), also where the
    autotune cache was off (no "hit"/"miss" state)."""
    kernel = _kernel("triton_poi_fused_5", {"autotune_cache_state": "force_disabled"},
                     configs=[triton.Config({"XBLOCK": 64}), triton.Config({"XBLOCK": 128})])
    monkeypatch.setattr(PyCodeCache, "modules", [_module("/c/g.py", k=kernel)])
    [record] = autotune_record.collect(0)["kernels"]
    assert record["num_configs"] == 2 and record["cache"] == "force_disabled" and record["chosen"] is None


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
        ]}},
        "old-run": {},  # a JSON written before the record existed
    }
    text = "\n".join(report.autotune_markdown(modes))
    assert text.startswith("### Launch configurations chosen at run time")
    assert "**tscompile-triton**: 2 kernels" in text and "**eager**" not in text and "old-run" not in text
    assert "| g1.py | `triton_poi_fused_1` | benchmarked (3 candidates) | XBLOCK 256, num_warps 4 |" in text
    assert "| g2.py | `triton_red_fused_2` | coordinate descent, autotune cache hit | - (never launched) |" in text
    monkeypatch.setattr(report, "AUTOTUNE_ROWS_PER_MODE", 1)
    assert "2 kernels (1 more in the JSON)" in "\n".join(report.autotune_markdown(modes))
    assert report.autotune_markdown({"eager": modes["eager"], "old-run": {}}) == []
