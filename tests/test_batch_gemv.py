"""passes/batch_gemv.py and ``tscompile::skinny_mm``: the decode batch graph's listed projections choose
the Triton kernel or cuBLAS at run time, by the step's row count.

The pass acts on the engine's CUDA decode batch graph only, with ``KernelPolicy.batch_gemv`` (on by
default); here it runs on CPU graphs by naming the CPU device (the kernel runs under the interpreter,
which conftest turns on)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tscompile
import tscompile.piece_compiler as piece_compiler
from tscompile.config import TscompileConfig
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops import triton_gemv as tg
from tscompile.passes.pass_chain import PassChain
from tscompile.kernel_policy import KernelPolicy
from tscompile.passes.batch_gemv import BatchGemv, swap_batch_matmuls
from tscompile.passes.residual_addmm import UnfuseResidualAddmm

from helpers import PROMPTS, ids, post_grad_passes, small_llm

aten = torch.ops.aten
DOT = (16, 64, 1, 4, 1, "dot")


def _counting_gemv(monkeypatch, pdl_calls: list | None = None) -> list:
    """The (M, N, K, launch) of every ``gemv`` call from now on; ``pdl_calls`` gets each call's ``pdl``."""
    calls, real = [], tg.gemv
    pdl_calls = [] if pdl_calls is None else pdl_calls

    def gemv(x, w, out=None, config=None, **kw):
        calls.append((x.shape[0], *w.shape, config))
        pdl_calls.append(kw.get("pdl", False))
        return real(x, w, out, config, **kw)

    monkeypatch.setattr(tg, "gemv", gemv)
    return calls


def test_skinny_mm_takes_the_kernel_only_at_a_listed_row_count(monkeypatch):
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(4, 24, 48): DOT})
    calls = _counting_gemv(monkeypatch)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 48, generator=g)
    for m in (4, 3, 5):
        x = torch.randn(m, 48, generator=g)
        out = torch.ops.tscompile.skinny_mm(x, w)
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)
    assert calls == [(4, 24, 48, DOT)]  # rows 3 and 5 are not listed: x @ w.T


def test_the_batch_table_takes_each_row_counts_pick_that_beat_cublas():
    """From a sweep's ``best_by_m``: row counts above 1 whose launch beat cuBLAS by the margin; M = 1
    is the decode table's."""
    summary = {"m/qkv": {"n": 6144, "k": 4096, "best_by_m": {
        "1": {"best": [1, 512, 1, 8, 1, "acc"], "speedup": 1.3},
        "16": {"best": [64, 128, 1, 4, 4, "dot"], "speedup": 1.01},   # within the margin
        "32": {"best": [128, 128, 2, 8, 3, "dot"], "speedup": 1.1},
        "64": {"best": [128, 128, 2, 8, 3, "dot"], "speedup": 1.2},   # past the kernel's MAX_ROWS
    }}, "m/o": {"n": 4096, "k": 4096, "best_by_m": {"32": {"best": None, "speedup": None}}}}
    assert tg.batch_table_from_sweep({"summary": summary}) == {(32, 6144, 4096): (128, 128, 2, 8, 3, "dot")}


def _projections(x, w_listed, w_other, r):
    return x @ w_listed.T, x @ w_other.T, torch.addmm(r, x, w_listed.T)


class _Projections(torch.nn.Module):
    def forward(self, x, w_listed, w_other, r):
        return _projections(x, w_listed, w_other, r)


def _inputs(rows):
    g = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(8, 48, generator=g),
            torch.randn(rows, 24, generator=g))


def test_the_pass_swaps_the_listed_weights_at_any_row_count(monkeypatch):
    """Exported with a symbolic row count (as the decode batch graph is compiled): the listed weight's matmul and
    its residual addmm become ``skinny_mm`` (the residual added after it), the other stays; the graph
    then gives the matmuls' values at a listed row count (the kernel) and at another (cuBLAS)."""
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(4, 24, 48): DOT})
    calls = _counting_gemv(monkeypatch)
    rows = torch.export.Dim("rows", min=2, max=64)
    ep = torch.export.export(_Projections(), _inputs(4), dynamic_shapes=({0: rows}, None, None, {0: rows}))
    gm = ep.run_decompositions().graph_module
    assert swap_batch_matmuls(gm.graph, devices=("cpu",)) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.tscompile.skinny_mm.default) == 2
    assert targets.count(aten.mm.default) == 1 and aten.addmm.default not in targets
    for rows, kernel_calls in ((4, 2), (6, 0)):
        calls.clear()
        x, w, w_other, r = _inputs(rows)
        listed, other, residual = gm(x, w, w_other, r)
        torch.testing.assert_close(listed, x @ w.T, rtol=1e-5, atol=1e-4)
        assert torch.equal(other, x @ w_other.T)
        torch.testing.assert_close(residual, r + x @ w.T, rtol=1e-5, atol=1e-4)
        assert len(calls) == kernel_calls


def test_nothing_is_swapped_on_other_devices_or_with_an_empty_table(monkeypatch):
    gm = make_fx(_projections)(*_inputs(4))
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {})
    assert swap_batch_matmuls(gm.graph, devices=("cpu",)) == 0
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(4, 24, 48): DOT})
    assert swap_batch_matmuls(gm.graph) == 0  # CUDA only by default


def test_split_cuda_pieces_get_only_the_residual_addmm_pass(monkeypatch):
    """The prefill pieces get no GEMV swap (it was measured within 1% either way), whatever the policy."""
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA H200")
    with piece_compiler.engine_graphs():
        got = piece_compiler.piece_inductor_patches(TscompileConfig(), False, device_type="cuda", split_piece=True,
                                                    cudagraph_trees=False)
    assert [type(p) for p in post_grad_passes(got)] == [UnfuseResidualAddmm]


def test_the_inductor_cache_key_follows_the_table(monkeypatch):
    empty = BatchGemv().uuid()
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(4, 24, 48): DOT})
    assert BatchGemv().uuid() != empty
    chain = PassChain([BatchGemv(), UnfuseResidualAddmm()])
    assert chain.uuid() == PassChain([BatchGemv(), UnfuseResidualAddmm()]).uuid() != UnfuseResidualAddmm().uuid()


def _engine_with_the_cpu_pass(monkeypatch, graphs, num_prompts: int, decode_ladder) -> tuple[list, list]:
    """The compiled CPU engine (llama-tiny, float32) with the swap (on CPU graphs) in the graphs that
    ``graphs(static, split_piece)`` picks, the qkv weight listed at every row count the kernel takes:
    asserts the eager engine's greedy tokens; returns (swaps per compiled graph, kernel calls)."""
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(m, 512, 256): DOT for m in range(2, tg.MAX_ROWS + 1)})
    params = tscompile.SamplingParams(max_new_tokens=3)
    prompts = [p for p in PROMPTS if len(p) > 1][:num_prompts]
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(prompts, params))

    class CpuPass(BatchGemv):
        def __call__(self, graph):
            swapped.append(swap_batch_matmuls(graph, devices=("cpu",), pdl=self.pdl))

    swapped = []
    real_patches = piece_compiler.piece_inductor_patches

    def patches_with_the_pass(config, static, **kw):
        patches = real_patches(config, static, **kw)
        if graphs(static, kw["split_piece"]):  # compiled, not loaded from the cache, so the pass runs
            patches.update(post_grad_custom_post_pass=CpuPass(), force_disable_caches=True)
        return patches

    calls = _counting_gemv(monkeypatch)
    monkeypatch.setattr(piece_compiler, "piece_inductor_patches", patches_with_the_pass)
    llm = small_llm(dtype=torch.float32, enforce_eager=False, compile_options={"decode_ladder": decode_ladder})
    assert ids(llm.generate(prompts, params)) == want
    return swapped, calls


def test_the_swap_with_pdl_asks_the_kernel_for_pdl(monkeypatch):
    """``pdl=True`` (a decode graph whose Inductor kernels launch with PDL): the swapped ``skinny_mm``
    calls carry it and pass it to the kernel; cuBLAS still runs at an unlisted row count."""
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(4, 24, 48): DOT})
    pdl_calls = []
    calls = _counting_gemv(monkeypatch, pdl_calls)
    gm = make_fx(_projections)(*_inputs(4))
    assert swap_batch_matmuls(gm.graph, devices=("cpu",), pdl=True) == 2
    gm.recompile()
    swapped = [n for n in gm.graph.nodes if n.target is torch.ops.tscompile.skinny_mm.default]
    assert len(swapped) == 2 and all(n.kwargs == {"pdl": True} for n in swapped)
    x, w, w_other, r = _inputs(4)
    listed, other, residual = gm(x, w, w_other, r)
    torch.testing.assert_close(listed, x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(residual, r + x @ w.T, rtol=1e-5, atol=1e-4)
    assert len(calls) == 2 and pdl_calls == [True, True]
    x = torch.randn(3, 48)
    calls.clear()
    assert torch.equal(torch.ops.tscompile.skinny_mm(x, w, pdl=True), x @ w.T) and not calls  # 3 rows: unlisted


@pytest.mark.parametrize("batch_gemv, static, split_piece, pdl, engine, gpu, wanted", [
    (True, False, False, True, True, "NVIDIA H200", BatchGemv(pdl=True)),    # the default: the engine's decode batch graph
    (True, False, False, False, True, "NVIDIA H200", BatchGemv(pdl=False)),  # decode_pdl=False: nor the kernel
    (False, False, False, True, True, "NVIDIA H200", None),                  # batch_gemv=False
    (True, False, False, True, True, "NVIDIA H100 80GB HBM3", None),          # not where the table was timed
    (True, False, False, True, False, "NVIDIA H200", None),                  # a torch.compile user's dynamic graph
    (True, True, False, True, True, "NVIDIA H200", "DecodeGemv"),            # the bs=1 graph keeps the one-row pass
    (True, False, True, True, True, "NVIDIA H200", UnfuseResidualAddmm),     # a prefill piece
])
def test_dynamic_decode_graphs_get_the_few_row_swap_with_batch_gemv(monkeypatch, batch_gemv, static, split_piece, pdl,
                                                                    engine, gpu, wanted):
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: gpu)
    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": True)
    config = TscompileConfig(kernels=KernelPolicy(batch_gemv=batch_gemv, decode_pdl=pdl))
    with piece_compiler.engine_graphs() if engine else contextlib.nullcontext():
        got = piece_compiler.piece_inductor_patches(config, static, device_type="cuda",
                                                    split_piece=split_piece, cudagraph_trees=False)
    got = post_grad_passes(got)
    if isinstance(wanted, BatchGemv):
        assert len(got) == 1 and isinstance(got[0], BatchGemv) and got[0].pdl is wanted.pdl
    elif wanted == "DecodeGemv":
        assert [type(p).__name__ for p in got] == ["DecodeGemv"]
    elif wanted is None:
        assert got == []
    else:
        assert len(got) == 1 and isinstance(got[0], wanted)


def test_the_cache_key_follows_pdl():
    assert BatchGemv(pdl=True).uuid() != BatchGemv(pdl=False).uuid() == BatchGemv().uuid()


def test_an_engine_with_batch_gemv_gives_the_eager_tokens_and_runs_the_kernel_at_the_batch_sizes(monkeypatch):
    """The swap in the dynamic-batch decode graph: the eager engine's tokens, and the kernel ran for the
    listed shape only, at the decode batch's row count (on the CPU no graph pads the three requests to
    the ladder's 4)."""
    swapped, calls = _engine_with_the_cpu_pass(monkeypatch, lambda static, split_piece: not static and not split_piece,
                                               3, (1, 2, 4))
    assert swapped and sum(swapped) >= 2  # the qkv projection of each layer
    assert calls and {(n, k) for _, n, k, _ in calls} == {(512, 256)}
    assert {m for m, _, _, _ in calls} == {3}, calls


def test_the_shipped_few_row_table_holds_checked_launches_at_the_kernels_row_counts():
    """The table the decode batch graphs take by default (H200 sweep): every launch one the kernel
    accepts, every row count one it takes (2..MAX_ROWS), each weight shape a llama projection's."""
    assert tg.BATCH_GEMV_CONFIGS
    for (m, n, k), launch in tg.BATCH_GEMV_CONFIGS.items():
        assert 1 < m <= tg.MAX_ROWS
        assert tg.check_config(launch) == tuple(launch)
        assert (n, k) in {(2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336)}  # o and down of llama-1b and -8b


def test_the_shipped_few_row_table_is_the_recorded_sweeps_picks():
    """The default table is exactly what the recorded H200 sweeps picked (each launch that beat
    cuBLAS by TABLE_MIN_SPEEDUP: at 8 and 32 rows, and at 1, 2, 4, 16 and 24), so the launches the
    default runs are the ones the sweeps timed and checked."""
    import json
    import pathlib

    results = pathlib.Path(__file__).parents[1] / "bench/results/gemv-few-row-sweeps-h200"
    picks = {}
    for sweep in ("rows-8-32.json", "rows-1-2-4-16-24.json"):
        table = tg.batch_table_from_sweep(json.loads((results / sweep).read_text()))
        assert table and not picks.keys() & table.keys(), f"{sweep}: no picks, or rows another sweep timed"
        picks |= table
    assert picks == tg.BATCH_GEMV_CONFIGS
