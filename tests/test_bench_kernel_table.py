"""``tscompile bench --kernel-table``: the profiled pass runs after each row's timed runs, and its
tables (CPU ops here, CUDA kernels on a GPU) reach the JSON and the markdown.

No timing is asserted: the order of the runs, the tables' structure, the top-N limit, the shares and
the matmul bytes behind a GB/s figure."""

from __future__ import annotations

import argparse
import json
import random
from types import SimpleNamespace

import pytest
import torch

from tscompile.bench import cli as bench_cli
from tscompile.bench import kernel_table, report
from tscompile.bench.workloads import EngineRunner, StaticCacheRunner
from tscompile.cli import main as tscompile_main
from tscompile.models import PRESETS, build_model
from helpers import one_thread_fixture

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

TABLE_KEYS = {"activity", "steps", "top_n", "distinct", "kernels_per_step", "kernel_ms_per_step", "step_bytes",
              "step_gbps", "top"}
KERNEL_KEYS = {"name", "count_per_step", "us_per_step", "share_pct", "gbps"}
INPUT_LEN, OUTPUT_LEN, PREFILL_LEN = 8, 6, 8


def _bench(tmp_path, *extra: str, device: str = "cpu") -> tuple[dict, str]:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--model", "llama-tiny", "--device", device, "--batch-size", "1", "2", "--input-len",
            str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--prefill-lens", str(PREFILL_LEN), "--num-iters", "1",
            "--num-iters-warmup", "1", "--modes", "eager", "--no-reference", "--output-json", str(out_json),
            "--output-md", str(out_md), "--no-progress", "--bandwidth-mib", "16", *extra]
    assert tscompile_main(argv) == 0
    return json.loads(out_json.read_text()), out_md.read_text()


@pytest.fixture
def run_log(monkeypatch):
    """What ran, in order: the runner's batches (``window`` says whether it was the profiled one) and
    prefills, and every profiler's start and stop."""
    log: list[tuple] = []
    run_batch, run_prefill, new_profiler = EngineRunner.run_batch, EngineRunner.run_prefill, kernel_table.new_profiler

    def logged_batch(self, prompts, output_len, per_call=False, window=None):
        log.append(("batch", len(prompts), "profiled" if window is not None else "plain"))
        return run_batch(self, prompts, output_len, per_call, window)

    def logged_prefill(self, prompt):
        log.append(("prefill", len(prompt)))
        return run_prefill(self, prompt)

    def logged_profiler(device_type):
        prof = new_profiler(device_type)
        start, stop = prof.start, prof.stop

        def logged_start():
            log.append(("profiler start",))
            start()

        def logged_stop():
            log.append(("profiler stop",))
            stop()

        prof.start, prof.stop = logged_start, logged_stop  # `with prof:` calls self.start()/self.stop()
        return prof

    monkeypatch.setattr(EngineRunner, "run_batch", logged_batch)
    monkeypatch.setattr(EngineRunner, "run_prefill", logged_prefill)
    monkeypatch.setattr(kernel_table, "new_profiler", logged_profiler)
    return log


def _decode_mm_bytes(bs: int, itemsize: int = 4) -> int:
    """Inputs of one decode step's matmuls in the eager engine: every layer's wqkv, wo, w13, w2 and the
    output projection, each an ``[bs, in] @ [in, out]`` whose two operands are read."""
    cfg = PRESETS["llama-tiny"]
    hd = cfg.head_dim
    shapes = [(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd), (cfg.n_heads * hd, cfg.dim),
              (cfg.dim, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.dim)] * cfg.n_layers
    shapes.append((cfg.dim, cfg.vocab_size))
    return itemsize * sum(bs * k + k * n for k, n in shapes)


def test_kernel_tables_run_after_every_timed_row_of_the_mode_and_reach_json_and_markdown(tmp_path, run_log):
    result, md = _bench(tmp_path, "--kernel-table", "--kernel-table-top", "5", "--kernel-table-steps", "2")
    # every row's warm-up and timed runs first (a finished profiler run may slow what follows it),
    # then per decode row one profiled batch, per prefill row the profiled prefills (2 steps) inside
    # one profiler
    timed = lambda bs: [("batch", bs, "plain"), ("batch", bs, "plain")]
    profiled = lambda bs: [("batch", bs, "profiled"), ("profiler start",), ("profiler stop",)]
    prefill_profiled = [("profiler start",)] + [("prefill", PREFILL_LEN)] * 2 + [("profiler stop",)]
    assert run_log == (timed(1) + timed(2) + [("prefill", PREFILL_LEN)] * 2
                       + profiled(1) + profiled(2) + prefill_profiled)

    rows = result["results"] + result["prefill"]
    assert len(rows) == 3
    for r in rows:
        assert r["error"] is None
        kt = r["kernel_table"]
        assert set(kt) == TABLE_KEYS, kt.get("error")
        assert kt["activity"] == "cpu ops (self time)" and kt["steps"] == 2 and kt["top_n"] == 5
        assert kt["distinct"] > 5 and len(kt["top"]) == 5  # the limit holds where there are more
        assert all(set(k) == KERNEL_KEYS for k in kt["top"])
        times = [k["us_per_step"] for k in kt["top"]]
        assert times == sorted(times, reverse=True) and times[-1] >= 0
        assert kt["kernel_ms_per_step"] * 1e3 >= sum(times) > 0
        shares = [k["share_pct"] for k in kt["top"]]
        assert all(s >= 0 for s in shares) and sum(shares) <= 100.0 + 1e-9
        for k in kt["top"]:
            assert k["share_pct"] == pytest.approx(100 * k["us_per_step"] / (kt["kernel_ms_per_step"] * 1e3))
    for r in result["results"]:
        # the timed figures are the timed runs' own: the profiled batch added no step to them
        assert r["decode_steps_per_iter"] == OUTPUT_LEN - 1 and r["timed_runs"]["decode_eager"] == OUTPUT_LEN - 1
        kt = r["kernel_table"]
        assert kt["step_bytes"] == r["step_bytes"]
        assert kt["step_gbps"] == pytest.approx(r["step_bytes"] / (kt["kernel_ms_per_step"] * 1e-3) / 1e9)
        # the matmuls' GB/s carries exactly their operands' bytes per step
        mm = next(k for k in kt["top"] if k["name"] == "aten::mm")
        assert mm["count_per_step"] == 9
        assert mm["gbps"] * 1e9 * mm["us_per_step"] * 1e-6 == pytest.approx(_decode_mm_bytes(r["batch_size"]))
        assert all(k["gbps"] is None for k in kt["top"] if k["name"] not in kernel_table.MATMUL_OPS)
    assert result["prefill"][0]["kernel_table"]["step_gbps"] is None  # a prefill is bound by FLOPs

    assert "### Kernels" in md
    for label in ("**decode eager bs=1**", "**decode eager bs=2**", f"**prefill eager {PREFILL_LEN} tokens**"):
        assert label in md, label
    assert md.count("| op | count/step | us/step | % of step | GB/s |") == 3
    assert "| aten::mm | 9.0 |" in md


def test_without_the_flag_nothing_is_profiled(tmp_path, run_log):
    result, md = _bench(tmp_path)
    assert not any(e[0].startswith("profiler") for e in run_log)
    assert all(e[-1] == "plain" for e in run_log if e[0] == "batch")
    assert not any("kernel_table" in r for r in result["results"] + result["prefill"])
    assert "### Kernels" not in md


@pytest.mark.parametrize("flag", ["--kernel-table-top", "--kernel-table-steps"])
def test_kernel_table_sizes_below_one_refused(flag):
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--device", "cpu", "--kernel-table", flag, "0"])
    with pytest.raises(ValueError, match=f"^tscompile: {flag} 0 must be >= 1"):
        bench_cli.fill_defaults(args)


def test_step_window_profiles_the_static_cache_runners_decode_steps():
    """The window holds exactly the decode steps it names; one the run ends inside stops at ``finish``."""
    runner = StaticCacheRunner(build_model("llama-tiny", seed=0), "compile-default", torch.device("cpu"),
                               compiled=False)
    prompt = [[3, 1, 4, 1, 5]]
    for start, count, profiled in ((1, 2, 2), (2, 5, 1)):  # 4 new tokens: decode steps 0, 1 and 2
        window = kernel_table.StepWindow("cpu", start, count)
        runner.run_batch(prompt, 4, window=window)
        window.finish()
        assert window.steps == profiled
        stats = kernel_table.stats_of(window.prof, "cpu", default_itemsize=4)
        # every step's matmuls: 2 layers x (wqkv, wo, w13, w2) + the output projection
        assert stats["aten::mm"].count == 9 * profiled and stats["aten::mm"].attributable


# -- the CUDA attribution, on synthetic profiler events -----------------------------------------
CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _op(id_, name, shapes=(), dtypes=(), linked=0):
    return SimpleNamespace(id=id_, name=name, device_type=CPU, is_async=False, input_shapes=list(shapes),
                           input_dtypes=list(dtypes), linked_correlation_id=linked)


def _kernel(name, start, end, linked, annotation=False):
    return SimpleNamespace(name=name, device_type=CUDA, time_range=SimpleNamespace(start=start, end=end),
                           linked_correlation_id=linked, is_user_annotation=annotation)


def _linked(events):
    """What torch's profiler does after collecting: each frontend CPU op (no linked id of its own)
    gets the device activities whose linked id is its id, as ``kernels``."""
    for op in events:
        if op.device_type == CPU:
            op.kernels = [SimpleNamespace(name=k.name, device=0, duration=k.time_range.end - k.time_range.start)
                          for k in events if op.linked_correlation_id == 0 and k.device_type == CUDA
                          and k.linked_correlation_id == op.id]
    return events


def test_record_function_ranges_on_the_device_timeline_are_not_kernels():
    events = [_op(1, "aten::mm", [[4, 64], [64, 32]], ["c10::BFloat16", "c10::BFloat16"]),
              _kernel("## Call CompiledFxGraph abc ##", 0.0, 9.0, linked=0, annotation=True),
              _kernel("gemm", 1.0, 3.0, linked=1)]
    stats = kernel_table._cuda_stats(_linked(events), default_itemsize=2)
    assert list(stats) == ["gemm"] and stats["gemm"].us == pytest.approx(2.0) and stats["gemm"].attributable


def test_cuda_matmul_bytes_only_for_a_matmul_ops_sole_kernel():
    events = [
        _op(1, "aten::mm", [[4, 64], [64, 32]], ["c10::BFloat16", "c10::BFloat16"]),
        _kernel("gemm", 0.0, 2.0, linked=1),
        # a split-K matmul: two kernels behind one op, neither knows its share of the bytes
        _op(2, "aten::mm", [[4, 64], [64, 32]], ["c10::BFloat16", "c10::BFloat16"]),
        _kernel("splitk_gemm", 2.0, 5.0, linked=2), _kernel("splitk_reduce", 5.0, 6.0, linked=2),
        # a graph replay's kernel: no aten op behind it; a runtime event with a colliding id is no op
        _op(3, "cudaGraphLaunch", linked=77), _kernel("triton_red_fused_mm_0", 6.0, 10.5, linked=3),
        # addmm: the bias counts, the scalar arguments (empty shapes) do not; dtype float32
        _op(4, "aten::addmm", [[32], [4, 64], [64, 32], [], []], ["float", "float", "float", "Scalar", "Scalar"]),
        _kernel("gemm", 10.5, 12.5, linked=4),
    ]
    stats = kernel_table._cuda_stats(_linked(events), default_itemsize=2)
    assert stats["gemm"].count == 2 and stats["gemm"].us == pytest.approx(4.0) and stats["gemm"].attributable
    assert stats["gemm"].matmul_bytes == (4 * 64 + 64 * 32) * 2 + (32 + 4 * 64 + 64 * 32) * 4
    assert not stats["splitk_gemm"].attributable and not stats["splitk_reduce"].attributable
    assert not stats["triton_red_fused_mm_0"].attributable
    t = kernel_table.table(stats, steps=2, device_type="cuda", top=3, step_bytes=10_000)
    assert t["activity"] == "cuda kernels" and t["kernels_per_step"] == 2.5 and len(t["top"]) == 3
    assert t["kernel_ms_per_step"] == pytest.approx(6.25e-3)
    assert t["step_gbps"] == pytest.approx(10_000 / 6.25e-6 / 1e9)
    by_name = {k["name"]: k for k in t["top"]}
    assert list(by_name) == ["triton_red_fused_mm_0", "gemm", "splitk_gemm"]  # by time; splitk_reduce cut
    assert by_name["gemm"]["gbps"] == pytest.approx(stats["gemm"].matmul_bytes / 4.0e-6 / 1e9)
    assert by_name["triton_red_fused_mm_0"]["gbps"] is None and by_name["splitk_gemm"]["gbps"] is None
    assert sum(k["share_pct"] for k in t["top"]) == pytest.approx(100 * 11.5 / 12.5)


def test_the_device_timeline_counts_overlapping_kernels_once_and_splits_bursts_at_host_pauses():
    gap = kernel_table.BURST_GAP_US
    rng = random.Random(7)
    for _ in range(20):
        # two steps: kernels a few us apart, one pair overlapping (PDL), then a host pause
        lo = rng.uniform(0.0, 50.0)
        first = [(lo, lo + 4.0), (lo + 3.0, lo + 6.0), (lo + 5.5, lo + 5.8), (lo + 6.0 + gap / 2, lo + 9.0 + gap / 2)]
        lo2 = first[-1][1] + gap + rng.uniform(1.0, 200.0)
        second = [(lo2, lo2 + 2.5), (lo2 + 2.5, lo2 + 7.0)]  # back to back: no pause, no overlap
        intervals = first + second
        rng.shuffle(intervals)
        tl = kernel_table._timeline(intervals)
        assert len(tl.bursts) == 2
        (span1, busy1), (span2, busy2) = tl.bursts
        assert span1 == pytest.approx(9.0 + gap / 2) and busy1 == pytest.approx(6.0 + 3.0)
        assert span2 == pytest.approx(7.0) and busy2 == pytest.approx(7.0)
        assert tl.busy_us == pytest.approx(busy1 + busy2)
    assert kernel_table._timeline([]).bursts == [] and kernel_table._timeline([]).busy_us == 0.0


def test_the_kernel_table_reports_the_device_span_only_with_one_burst_per_step():
    stats = {"k": kernel_table.KernelStat(count=4, us=20.0)}
    two = kernel_table.DeviceTimeline(busy_us=16.0, bursts=[(9.0, 7.0), (11.0, 9.0)])
    t = kernel_table.table(stats, steps=2, device_type="cuda", top=3, timeline=two)
    assert t["device_busy_ms_per_step"] == pytest.approx(8.0e-3) and t["device_bursts"] == 2
    assert t["device_span_ms_per_step"] == pytest.approx(10.0e-3)
    assert t["device_pause_ms_per_step"] == pytest.approx(2.0e-3)
    heading = report.kernel_section("prefill x 32 tokens", t).splitlines()[0]
    assert "the device busy 0.008 ms per step" in heading and "span 0.010 ms on the device, 0.002 of it pauses" in heading
    # decode steps run back to back (the host works ahead): the bursts are not the steps
    merged = kernel_table.DeviceTimeline(busy_us=16.0, bursts=[(20.0, 16.0)])
    t = kernel_table.table(stats, steps=2, device_type="cuda", top=3, timeline=merged)
    assert t["device_span_ms_per_step"] is None and t["device_pause_ms_per_step"] is None
    heading = report.kernel_section("decode", t).splitlines()[0]
    assert "the device busy 0.008 ms per step" in heading and "span" not in heading
    assert "device" not in report.kernel_section("cpu", kernel_table.table(stats, 2, "cpu", 3)).splitlines()[0]


# -- on the GPU -----------------------------------------------------------------------------------
def _attribution_evidence(prof) -> str:
    """What the profiler linked, for a failed attribution: each kernel's linked id and the CPU events
    carrying that id (as their own id or as their linked id)."""
    events = list(prof.events())
    lines = []
    for k in [e for e in events if e.device_type == CUDA][:6]:
        corr = getattr(k, "linked_correlation_id", None)
        own = [(e.name, e.id, getattr(e, "linked_correlation_id", None), e.is_async) for e in events
               if e.device_type == CPU and e.id == corr]
        linked = [(e.name, e.id) for e in events if e.device_type == CPU and getattr(e, "linked_correlation_id", 0) == corr]
        lines.append(f"kernel {k.name[:40]!r} id={k.id} linked={corr} user_annotation={getattr(k, 'is_user_annotation', None)}"
                     f" | cpu events with id==linked: {own} | cpu events linked to it: {linked}")
    mms = [(e.name, e.id, getattr(e, "linked_correlation_id", None), e.input_shapes) for e in events if e.name == "aten::mm"]
    return "\n".join(lines + [f"aten::mm events: {mms[:3]}"])


@pytest.mark.gpu
def test_kernel_table_on_cuda_lists_kernels(tmp_path):
    result, md = _bench(tmp_path, "--kernel-table", device="cuda")
    for r in result["results"] + result["prefill"]:
        kt = r["kernel_table"]
        assert "error" not in kt, kt
        assert kt["activity"] == "cuda kernels" and kt["kernels_per_step"] > 0 and kt["kernel_ms_per_step"] > 0
        assert 0 < len(kt["top"]) <= kernel_table.DEFAULT_TOP
        assert sum(k["share_pct"] for k in kt["top"]) <= 100.0 + 1e-9
        assert 0 < kt["device_busy_ms_per_step"] <= kt["kernel_ms_per_step"] + 1e-9
        if kt["device_span_ms_per_step"] is not None:
            assert kt["device_span_ms_per_step"] >= kt["device_busy_ms_per_step"] - 1e-9
    assert "| kernel | count/step |" in md and "the device busy" in md


@pytest.mark.gpu
def test_cuda_kernel_times_see_graph_replays_and_attribute_eager_matmuls():
    g = torch.Generator(device="cuda").manual_seed(0)
    # M large enough that cuBLAS picks one kernel, not a split-K pair (whose kernels get no bytes)
    a = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    def step():
        with torch.profiler.record_function("an annotation around the matmul"):
            torch.mm(a, b)

    prof = kernel_table.profile_calls(step, 3, "cuda")
    stats = kernel_table.stats_of(prof, "cuda")
    assert not any("annotation" in name for name in stats)  # ranges on the device timeline are not kernels
    matmuls = [s for s in stats.values() if s.attributable]
    assert matmuls, _attribution_evidence(prof)
    assert all(s.matmul_bytes == s.count * (2048 * 1024 + 1024 * 4096) * 2 for s in matmuls)
    out = torch.empty(2048, 4096, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b, out=out)  # cuBLAS's workspace before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mm(a, b, out=out)
    replayed = kernel_table.kernel_times(graph.replay, reps=3)
    assert replayed and sum(t for _, t in replayed.values()) > 0


@pytest.mark.parametrize("paths, warned", [
    ({"decode_pdl": True, "gemv_pdl": False}, "decode_pdl"),
    ({"decode_pdl": False, "gemv_pdl": True, "prefill_pdl": True}, "gemv_pdl, prefill_pdl"),
    ({"decode_pdl": False, "gemv_pdl": False}, None),
    ({}, None),  # a run recorded before the switches
])
def test_the_kernels_section_says_when_pdl_made_kernel_times_overlap(paths, warned):
    table = {"activity": "cuda kernels", "steps": 3, "top_n": 15, "distinct": 1, "kernels_per_step": 1.0,
             "kernel_ms_per_step": 0.005, "step_bytes": 10_000, "step_gbps": 2.0,
             "top": [{"name": "k", "count_per_step": 1.0, "us_per_step": 5.0, "share_pct": 100.0, "gbps": None}]}
    result = {"env": {"kernel_paths": paths}, "prefill": [],
              "results": [{"mode": "tscompile-triton", "batch_size": 1, "kernel_table": table}]}
    note = report.kernels_markdown(result)[2]
    if warned is None:
        assert "PDL was on" not in note
    else:
        assert f"**PDL was on** ({warned})" in note


def test_the_pdl_note_names_the_modes_that_ran_with_it_where_variants_differ():
    """Per-mode kernel choices (a --kernel-variants run): the note names the modes with PDL on."""
    table = {"activity": "cuda kernels", "steps": 3, "top_n": 15, "distinct": 1, "kernels_per_step": 1.0,
             "kernel_ms_per_step": 0.005, "step_bytes": 10_000, "step_gbps": 2.0,
             "top": [{"name": "k", "count_per_step": 1.0, "us_per_step": 5.0, "share_pct": 100.0, "gbps": None}]}
    result = {"env": {"kernel_paths": {"decode_pdl": True}}, "prefill": [],
              "modes": {"tscompile-triton": {"kernel_paths": {"decode_pdl": True}},
                        "tscompile-triton@nopdl": {"kernel_paths": {"decode_pdl": False}}},
              "results": [{"mode": m, "batch_size": 1, "kernel_table": table}
                          for m in ("tscompile-triton", "tscompile-triton@nopdl")]}
    assert "**PDL was on** (decode_pdl in tscompile-triton)" in report.kernels_markdown(result)[2]
    result["modes"]["tscompile-triton"]["kernel_paths"]["decode_pdl"] = False
    assert "PDL was on" not in report.kernels_markdown(result)[2]  # the run's default is not what ran
