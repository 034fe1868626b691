"""passes/decode_gemv.py: the bs=1 decode graph's one-row projections through ``tscompile::gemv``.

The pass acts on CUDA graphs only (on by default on the GPUs its table was timed on; off with
TSCOMPILE_DECODE_GEMV=0); here it runs on CPU graphs
by naming the CPU device (the op's Triton kernel runs under the interpreter, which conftest turns
on), with llama-tiny's weight shapes put in the launch table."""

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
from tscompile.passes.decode_gemv import DecodeGemv, swap_decode_gemvs

from helpers import PROMPTS, ids, small_llm

aten = torch.ops.aten
# llama-tiny: qkv (4 + 2 x 2 heads of 64), output, gate/up; down and the LM head stay cuBLAS. Wide
# column blocks keep the interpreter's program count (its cost) low; the kernel's own tests cover 1-4.
TINY_TABLE = {
    (512, 256): (64, 128, 1, 4, 1, "acc"), (256, 256): (32, 256, 1, 4, 1, "acc"), (1024, 256): (128, 256, 1, 4, 1, "acc"),
}


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _projections(x, w_listed, w_other):
    return x @ w_listed.T, x @ w_other.T


def _inputs(rows=1):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 256, generator=g), torch.randn(256, 256, generator=g), torch.randn(24, 256, generator=g)


def test_a_listed_one_row_matmul_becomes_the_gemv_op_and_others_stay(monkeypatch):
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    gm = make_fx(_projections)(*_inputs())
    assert _targets(gm).count(aten.mm.default) == 2
    assert swap_decode_gemvs(gm.graph, devices=("cpu",)) == 1  # (24, 256) has no launch: cuBLAS keeps it
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(torch.ops.tscompile.gemv.default) == 1 and targets.count(aten.mm.default) == 1
    assert targets.count(aten.permute.default) == 1  # the swapped matmul's transpose is gone
    x, w, w_other = _inputs()
    listed, other = gm(x, w, w_other)
    torch.testing.assert_close(listed, x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(other, x @ w_other.T)


def test_a_residual_addmm_becomes_residual_plus_gemv_and_a_bias_addmm_stays(monkeypatch):
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)

    def layer(x, w, r, bias):
        return torch.addmm(r, x, w.T), torch.addmm(bias, x, w.T)

    x, w, _ = _inputs()
    r, bias = torch.randn(1, 256), torch.randn(256)
    gm = make_fx(layer)(x, w, r, bias)
    assert _targets(gm).count(aten.addmm.default) == 2
    assert swap_decode_gemvs(gm.graph, devices=("cpu",)) == 1
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 1 and targets.count(torch.ops.tscompile.gemv.default) == 1
    residual, biased = gm(x, w, r, bias)
    torch.testing.assert_close(residual, r + x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(biased, torch.addmm(bias, x, w.T))


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_pass_asks_each_call_for_pdl_as_told(monkeypatch, fuse, pdl):
    """``pdl`` (the graph's Inductor kernels launch with PDL): every swapped call, plain or with the
    residual fused, carries ``pdl=True`` and hands it to the kernel; without it no call asks."""
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    asked, real = [], tg.gemv

    def gemv(x, w, out=None, config=None, **kw):
        asked.append(kw.get("pdl"))
        return real(x, w, out, config, **kw)

    monkeypatch.setattr(tg, "gemv", gemv)

    def layer(x, w, r):
        return torch.addmm(r, x, w.T), x @ w.T

    x, w, _ = _inputs()
    r = torch.randn(1, 256)
    gm = make_fx(layer)(x, w, r)
    assert swap_decode_gemvs(gm.graph, devices=("cpu",), fuse=fuse, pdl=pdl) == 2
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.tscompile.gemv.default]
    assert [n.kwargs.get("pdl", False) for n in calls] == [pdl, pdl]
    residual, plain = gm(x, w, r)
    torch.testing.assert_close(residual, r + x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(plain, x @ w.T, rtol=1e-5, atol=1e-4)
    assert asked == [pdl, pdl]
    assert DecodeGemv(pdl=True).uuid() != DecodeGemv(pdl=False).uuid()


def test_cuda_only_by_default_and_one_row_only_and_not_for_a_strided_weight(monkeypatch):
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    assert swap_decode_gemvs(make_fx(_projections)(*_inputs()).graph) == 0  # a CPU graph, default devices
    two = make_fx(_projections)(*_inputs(rows=2))
    assert swap_decode_gemvs(two.graph, devices=("cpu",)) == 0  # the launches are sized for one row
    x, w, w_other = _inputs()
    strided = make_fx(_projections)(x, w.T.contiguous().T, w_other)  # [N, K] but K not contiguous
    assert swap_decode_gemvs(strided.graph, devices=("cpu",)) == 0


@pytest.mark.parametrize("shape", sorted(tg.DECODE_GEMV_CONFIGS))
def test_each_shipped_launch_is_valid_and_computes_its_shapes_product(shape):
    """The shipped table's launches, each run once at its real K on a few columns (the interpreter
    runs every program; N only sets how many)."""
    n, k = shape
    config = tg.DECODE_GEMV_CONFIGS[shape]
    assert tg.check_config(config) == tuple(config)
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(1, k, generator=g), torch.randn(config[0] * 3 - 1, k, generator=g)  # a tail block
    out = torch.full((1, w.shape[0]), float("nan"))
    tg.gemv(x, w, out, config=config)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-3)


def test_fuse_only_launches_join_the_table_only_with_the_fusion(monkeypatch):
    """A launch at parity with cuBLAS (DECODE_GEMV_FUSE_ONLY) is swapped in only when the fusion is
    on, since only the norm it absorbs makes it pay; the listed shapes are swapped either way."""
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {(256, 256): TINY_TABLE[(256, 256)]})
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE_ONLY", {(24, 256): (8, 128, 1, 4, 1, "acc")})
    for fuse, swapped in ((False, 1), (True, 2)):
        gm = make_fx(_projections)(*_inputs())
        assert swap_decode_gemvs(gm.graph, devices=("cpu",), fuse=fuse) == swapped
    assert set(tg.decode_gemv_configs(True)) == {(256, 256), (24, 256)}
    assert set(tg.decode_gemv_configs(False)) == {(256, 256)}


def test_the_inductor_cache_key_follows_the_launch_table(monkeypatch):
    """Which matmuls the pass swaps, and how, depends on the tables and the fusion flag: a graph
    compiled under one must not be reused from Inductor's cache under another."""
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE", False)
    keys = [DecodeGemv().uuid()]
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    keys.append(DecodeGemv().uuid())
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE", True)
    keys.append(DecodeGemv().uuid())
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSED_CONFIGS", {(512, 256): (2, 256, 1, 4, 1, "acc")})
    keys.append(DecodeGemv().uuid())
    assert len(set(keys)) == 4
    assert DecodeGemv().uuid() == keys[-1]


def _pdl_patches(monkeypatch, *, gemv_pdl, decode_pdl, prefill_pdl, available, static, split_piece, user,
                 engine=True) -> dict:
    """The Inductor patches of one CUDA graph on an H200 (the decode GEMV pass on) with these PDL
    switches, ``available`` standing in for the GPU's PDL, ``user``: the user's ``triton.enable_pdl``
    (None: unset); ``engine``: compiled as the engine's own step."""
    monkeypatch.setattr(tg, "DECODE_GEMV", True)
    monkeypatch.setattr(tg, "GEMV_PDL", gemv_pdl)
    monkeypatch.setattr(ta, "DECODE_PDL", decode_pdl)
    monkeypatch.setattr(ta, "PREFILL_PDL", prefill_pdl)
    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": available)
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA H200")
    config = TscompileConfig(inductor_options={} if user is None else {"triton.enable_pdl": user})
    with piece_compiler.engine_graphs() if engine else contextlib.nullcontext():
        return piece_compiler.piece_inductor_patches(config, static, device_type="cuda", split_piece=split_piece,
                                                     cudagraph_trees=False)


@pytest.mark.parametrize("flag, decode_pdl, available, static, split_piece, user, wanted", [
    (True, False, True, True, False, None, True),     # the bs=1 decode graph on a GPU with PDL
    (False, False, True, True, False, None, False),   # TSCOMPILE_GEMV_PDL=0
    (True, False, False, True, False, None, False),   # before Hopper
    (True, False, True, False, False, None, False),   # a dynamic-batch graph: no GEMV pass, no PDL
    (True, True, True, False, False, None, True),     # ... unless TSCOMPILE_DECODE_PDL=1
    (False, True, True, True, False, None, True),     # which covers the bs=1 graph too
    (True, True, False, False, False, None, False),   # before Hopper, neither
    (True, True, True, True, True, None, False),      # a prefill piece never
    (True, False, True, True, False, False, False),   # the user's option wins
])
def test_the_decode_graphs_get_inductors_pdl(monkeypatch, flag, decode_pdl, available, static, split_piece, user,
                                             wanted):
    """Inductor's ``triton.enable_pdl`` goes with the PDL launches of the kernels between its own: in the
    graph the decode GEMV pass runs in (TSCOMPILE_GEMV_PDL), and with TSCOMPILE_DECODE_PDL (the decode
    attention kernels) in every decode graph; in a prefill piece only with TSCOMPILE_PREFILL_PDL (off
    here, the next test)."""
    patches = _pdl_patches(monkeypatch, gemv_pdl=flag, decode_pdl=decode_pdl, prefill_pdl=False, available=available,
                           static=static, split_piece=split_piece, user=user)
    assert patches.get("triton.enable_pdl", False) is wanted
    assert patches.get("combo_kernels", False) is (static or split_piece)  # the other CUDA defaults stay
    if static and not split_piece:  # the decode GEMV pass's kernels launch with PDL exactly where the graph's do
        assert isinstance(patches["post_grad_custom_post_pass"], DecodeGemv)
        assert patches["post_grad_custom_post_pass"].pdl is (wanted and flag)


@pytest.mark.parametrize("user", [None, True])
def test_a_torch_compile_users_graphs_get_pdl_only_when_asked(monkeypatch, user):
    """Outside the engine's own step (``piece_compiler.engine_graphs``) no graph gets Inductor's PDL
    unasked, whatever the flags; asked for, the decode GEMV pass's kernels launch with it too."""
    for static, split_piece in ((True, False), (False, False), (False, True)):
        patches = _pdl_patches(monkeypatch, gemv_pdl=True, decode_pdl=True, prefill_pdl=True, available=True,
                               static=static, split_piece=split_piece, user=user, engine=False)
        assert patches.get("triton.enable_pdl", False) is bool(user)
        if static:
            assert patches["post_grad_custom_post_pass"].pdl is bool(user)


@pytest.mark.parametrize("prefill_pdl, available, split_piece, user, wanted", [
    (True, True, True, None, True),      # a prefill piece with TSCOMPILE_PREFILL_PDL
    (False, True, True, None, False),    # off by default
    (True, False, True, None, False),    # before Hopper
    (True, True, True, False, False),    # the user's option wins
])
def test_prefill_pieces_get_inductors_pdl_with_prefill_pdl(monkeypatch, prefill_pdl, available, split_piece, user,
                                                           wanted):
    patches = _pdl_patches(monkeypatch, gemv_pdl=True, decode_pdl=True,  # which never reaches a piece by itself
                           prefill_pdl=prefill_pdl, available=available, static=False, split_piece=split_piece,
                           user=user)
    assert patches.get("triton.enable_pdl", False) is wanted


@pytest.mark.parametrize("flag, static, device, gpu, table_file, user_pass, wanted", [
    (True, True, "cuda", "NVIDIA H200", "", None, True),            # on by default, where its table was timed
    (False, True, "cuda", "NVIDIA H200", "", None, False),          # TSCOMPILE_DECODE_GEMV=0
    (True, True, "cuda", "NVIDIA A100-SXM4-80GB", "", None, False),  # another GPU: its launches are untimed there
    (True, True, "cuda", "NVIDIA A100-SXM4-80GB", "a100.json", None, True),  # ... unless a sweep made there says
    (True, False, "cuda", "NVIDIA H200", "", None, False),          # a dynamic-batch graph: its matmuls are not one-row
    (True, True, "cpu", "", "", None, False),
    (True, True, "cuda", "NVIDIA H200", "", "mine", False),         # the user's own post-grad pass wins
])
def test_only_static_cuda_graphs_on_a_timed_gpu_get_the_pass(monkeypatch, flag, static, device, gpu, table_file,
                                                              user_pass, wanted):
    monkeypatch.setattr(tg, "DECODE_GEMV", flag)
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", table_file)
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: gpu)
    options = {"post_grad_custom_post_pass": user_pass} if user_pass else {}
    patches = piece_compiler.piece_inductor_patches(TscompileConfig(inductor_options=options), static,
                                                    device_type=device, split_piece=False, cudagraph_trees=False)
    assert isinstance(patches.get("post_grad_custom_post_pass"), DecodeGemv) == wanted


@pytest.mark.parametrize("fuse", [False, True])
def test_an_engine_with_the_pass_gives_the_eager_tokens_and_runs_the_op(monkeypatch, fuse):
    """The compiled CPU engine (llama-tiny, float32) with the pass in its static bs=1 decode graph:
    the eager engine's greedy tokens, and the op ran inside that graph's steps for exactly the listed
    shapes (llama-tiny's LM head has its qkv's shape, 512 x 256, so it is swapped too). ``fuse``: the
    model's own graph, not a stand-in: qkv, gate/up and the LM head take their norms, the output
    projection its residual, and no rsqrt is left."""
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    params = tscompile.SamplingParams(max_new_tokens=4)
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:1], params))

    class CpuDecodeGemv(DecodeGemv):
        def __call__(self, graph):
            swapped.append(swap_decode_gemvs(graph, devices=("cpu",), fuse=fuse))
            swapped.append(sum(n.target is aten.rsqrt.default for n in graph.nodes))

    swapped, calls = [], []
    real_patches, real_gemv = piece_compiler.piece_inductor_patches, tg.gemv

    def patches_with_the_pass(config, static, **kw):
        patches = real_patches(config, static, **kw)
        if static:  # compiled, not loaded from the cache, so the pass runs; other graphs may hit it
            patches.update(post_grad_custom_post_pass=CpuDecodeGemv(), force_disable_caches=True)
        return patches

    def counting_gemv(x, w, out=None, config=None, **fused):
        calls.append((tuple(w.shape), config, fused.get("norm_weight") is not None, fused.get("residual") is not None))
        return real_gemv(x, w, out, config, **fused)

    monkeypatch.setattr(piece_compiler, "piece_inductor_patches", patches_with_the_pass)
    monkeypatch.setattr(tg, "gemv", counting_gemv)
    llm = small_llm(dtype=torch.float32, enforce_eager=False, compile_options={"decode_ladder": (1,)})
    got = ids(llm.generate(PROMPTS[:1], params))
    assert got == want
    layers = llm.runner.model.config.n_layers
    # one static graph: qkv, output and gate/up of each layer, the LM head; unfused, a norm per layer
    # before qkv and gate/up and the final one stay
    assert swapped == [3 * layers + 1, 0 if fuse else 2 * layers + 1]
    assert {shape for shape, *_ in calls} == set(TINY_TABLE)
    assert all(config == TINY_TABLE[shape] for shape, config, *_ in calls)
    out_proj = (256, 256)
    assert {(shape, norm, res) for shape, _, norm, res in calls} == (
        {(shape, shape != out_proj, shape == out_proj) for shape in TINY_TABLE} if fuse
        else {(shape, False, False) for shape in TINY_TABLE})


def test_a_bench_run_records_the_launch_table_it_ran_with(monkeypatch):
    """With a GEMV pass on, a run's kernel_paths carry its table (which projections left cuBLAS and at
    which launch), the sweep file it came from and whether the kernel launched with PDL; with them
    off, none of these."""
    from tscompile.bench import report

    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(tg, "DECODE_GEMV", False)
    monkeypatch.setattr(tg, "BATCH_GEMV", False)  # the few-row table: below
    assert "decode_gemv_configs" not in report.kernel_paths()
    monkeypatch.setattr(tg, "DECODE_GEMV", True)
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", "/sweeps/gemv_sweep.json")
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE", False)
    assert report.kernel_paths()["decode_gemv_fuse"] is False
    assert report.kernel_paths()["decode_tuned_matmuls"] == {}  # another GPU's sweep: no tuned policy
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", "")
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    assert report.kernel_paths()["decode_tuned_matmuls"] == {"512x256": "gemv", "256x256": "cublas"}
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", "/sweeps/gemv_sweep.json")
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE", True)  # the fuse-only launches join the recorded table
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSE_ONLY", {(24, 256): (8, 128, 1, 4, 1, "acc")})
    paths = report.kernel_paths()
    want = {**TINY_TABLE, (24, 256): (8, 128, 1, 4, 1, "acc")}
    assert paths["decode_gemv_configs"] == {f"{n}x{k}": list(c) for (n, k), c in want.items()}
    assert paths["decode_gemv_fuse"] is True
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSED_CONFIGS", {(512, 256): (2, 256, 1, 4, 1, "acc")})
    monkeypatch.setattr(tg, "GEMV_FUSED_TABLE_FILE", "/sweeps/gemv_fused.json")
    paths = report.kernel_paths()
    assert paths["decode_gemv_fused_configs"] == {"512x256": [2, 256, 1, 4, 1, "acc"]}
    assert paths["gemv_fused_table_file"] == "/sweeps/gemv_fused.json"
    assert paths["gemv_table_file"] == "/sweeps/gemv_sweep.json" and "prefill_gemv_configs" not in paths
    monkeypatch.setattr(tg, "GEMV_PDL", True)
    assert paths["gemv_pdl"] is False and paths["gemv_peel"] is False  # no GPU with PDL here
    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": True)
    assert report.kernel_paths()["gemv_pdl"] is True
    monkeypatch.setattr(tg, "GEMV_PDL", False)
    assert report.kernel_paths()["gemv_pdl"] is False
    monkeypatch.setattr(tg, "PREFILL_GEMV_CONFIGS", {(32, 512, 256): (64, 128, 1, 4, 4, "dot")})
    for prefill, batch in ((True, False), (False, True)):  # the few-row table, for either pass that reads it
        monkeypatch.setattr(tg, "PREFILL_GEMV", prefill)
        monkeypatch.setattr(tg, "BATCH_GEMV", batch)
        paths = report.kernel_paths()
        assert (paths["prefill_gemv"], paths["batch_gemv"]) == (prefill, batch)
        assert paths["prefill_gemv_configs"] == {"32x512x256": [64, 128, 1, 4, 4, "dot"]}
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", "")
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    paths = report.kernel_paths()  # the flag on, but not the GPU the table was timed on: no swap, no table
    assert paths["batch_gemv"] is False and "prefill_gemv_configs" not in paths
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(tg, "BATCH_GEMV", False)
    assert "prefill_gemv_configs" not in report.kernel_paths()



# -- TSCOMPILE_DECODE_GEMV_FUSE: the norms and residual adds moved into the kernel ------------------


class _DecodeShaped(torch.nn.Module):
    """One layer's projections in the model's decode form: the output projection's residual add, the
    RMSNorm before the next projection, the final norm before the LM head's rows (llama.py's RMSNorm,
    the Inductor forms a real bs=1 graph has: residual ``addmm``, ``index`` of normed rows)."""

    def __init__(self, norm_shared: bool):
        super().__init__()
        from tscompile.models.llama import RMSNorm

        self.o = torch.nn.Linear(256, 256, bias=False)
        self.ffn_norm, self.final_norm = RMSNorm(256, 1e-5), RMSNorm(256, 1e-6)
        self.up = torch.nn.Linear(256, 1024, bias=False)  # gate and up, 512 each
        self.down = torch.nn.Linear(512, 256, bias=False)
        self.head = torch.nn.Linear(256, 512, bias=False)
        self.norm_shared = norm_shared
        for norm in (self.ffn_norm, self.final_norm):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)

    def forward(self, attn, r, rows):
        h = r + self.o(attn)
        normed = self.ffn_norm(h)
        gate, up = self.up(normed).chunk(2, dim=-1)
        h = h + self.down(torch.nn.functional.silu(gate) * up)
        logits = self.head(self.final_norm(h)[rows])
        # norm_shared: the norm's output has a second reader, so its matmul must not absorb it
        return (logits, normed * 2.0) if self.norm_shared else logits


def _compile_with_the_fused_pass(model, monkeypatch):
    gemv_calls, swapped = [], []
    real = tg.gemv

    def counting(x, w, out=None, config=None, **kw):
        gemv_calls.append((tuple(w.shape), kw.get("norm_weight") is not None, kw.get("residual") is not None,
                           bool(kw.get("swiglu"))))
        return real(x, w, out, config, **kw)

    class CpuFusedGemv(DecodeGemv):
        def __call__(self, graph):
            swapped.append(swap_decode_gemvs(graph, devices=("cpu",), fuse=True))
            swapped.append(sum(n.target is aten.rsqrt.default for n in graph.nodes))
            swapped.append(sum(n.target in (aten.exp.default, aten.split.Tensor, aten.silu.default,
                                            aten.sigmoid.default) for n in graph.nodes))

    monkeypatch.setattr(tg, "gemv", counting)
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {**TINY_TABLE, (256, 512): (32, 256, 1, 4, 1, "acc")})
    compiled = torch.compile(model, dynamic=False, fullgraph=True,
                             options={"post_grad_custom_post_pass": CpuFusedGemv(), "fx_graph_cache": False})
    return compiled, gemv_calls, swapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_pass_moves_norms_and_residuals_into_the_kernel_and_matches_eager(monkeypatch, dtype):
    """Listed: o (256 x 256), gate/up (1024 x 256), down (256 x 512), head (512 x 256). The o
    projection takes its residual, gate/up and the head their norms (the head's through the row
    index), down the SiLU-mul and its residual; no rsqrt, exp or split is left in the graph (bf16: the
    converts matched too); the outputs equal eager's, fresh inputs per call (bf16: within the rounding
    of the normalised x, which eager rounds to bf16 before its matmul and the kernel does not)."""
    torch.manual_seed(0)
    model = _DecodeShaped(norm_shared=False).to(dtype)
    compiled, calls, swapped = _compile_with_the_fused_pass(model, monkeypatch)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        attn, r = torch.randn(1, 256, generator=g).to(dtype), (torch.randn(1, 256, generator=g) * 4).to(dtype)
        rows = torch.tensor([0])
        with torch.no_grad():  # inference, as the engine runs: no activations kept for a backward
            got, want = compiled(attn, r, rows), model(attn, r, rows)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert swapped == [4, 0, 0]
    assert set(calls) == {((256, 256), False, True, False), ((1024, 256), True, False, False),
                          ((256, 512), False, True, True), ((512, 256), True, False, False)}


def test_fused_pass_leaves_a_norm_with_another_reader(monkeypatch):
    """The ffn norm's output is also returned: gate/up keeps reading it (no norm in its kernel), the
    final norm is still fused into the head, the SiLU-mul into down; both outputs equal eager's."""
    torch.manual_seed(0)
    model = _DecodeShaped(norm_shared=True)
    compiled, calls, swapped = _compile_with_the_fused_pass(model, monkeypatch)
    g = torch.Generator().manual_seed(3)
    args = torch.randn(1, 256, generator=g), torch.randn(1, 256, generator=g) * 4, torch.tensor([0])
    with torch.no_grad():
        for got, want in zip(compiled(*args), model(*args)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert swapped == [4, 1, 0]
    assert set(calls) == {((256, 256), False, True, False), ((1024, 256), False, False, False),
                          ((256, 512), False, True, True), ((512, 256), True, False, False)}


def _output_node(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


@pytest.mark.parametrize("form", ["silu", "sigmoid", "inductor"])
def test_silu_mul_matcher_takes_each_form_of_the_models_silu(form):
    """``match_silu_mul`` finds the [gate | up] tensor behind ``silu(gate) * up`` whether silu is kept,
    written with sigmoid, or in Inductor's own decomposition, and names every node it would erase."""
    from tscompile.passes.silu_mul_nodes import match_silu_mul

    silu = {"silu": torch.nn.functional.silu, "sigmoid": lambda g: g * torch.sigmoid(g),
            "inductor": lambda g: g / (1 + g.neg().exp())}[form]

    def f(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return silu(gate) * up

    gm = make_fx(f, tracing_mode="fake")(torch.randn(1, 64))
    found = match_silu_mul(_output_node(gm))
    assert found is not None and found[0].op == "placeholder"
    assert sum(n.op == "call_function" for n in gm.graph.nodes) == len(found[1])  # every op of f


def test_silu_mul_matcher_refuses_halves_of_two_tensors_and_a_swapped_order():
    from tscompile.passes.silu_mul_nodes import match_silu_mul

    def two(a, b):
        return torch.nn.functional.silu(a.chunk(2, dim=-1)[0]) * b.chunk(2, dim=-1)[1]

    def swapped(gate_up):  # silu of the second half: not the model's [gate | up] order
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(up) * gate

    assert match_silu_mul(_output_node(make_fx(two, tracing_mode="fake")(torch.randn(1, 64), torch.randn(1, 64)))) is None
    assert match_silu_mul(_output_node(make_fx(swapped, tracing_mode="fake")(torch.randn(1, 64)))) is None


def test_rms_norm_matcher_finds_the_models_norm_and_refuses_a_2d_weight():
    """``match_rms_norm`` on llama.py's RMSNorm (float32: no converts): its input, weight and eps; a
    weight that is not one vector of the row size is no RMSNorm of this kind."""
    from tscompile.models.llama import RMSNorm
    from tscompile.passes.rms_norm_nodes import match_rms_norm

    norm = RMSNorm(64, 1e-6)

    def traced(weight):  # the norm's own forward, its weight a graph input
        return make_fx(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
                       tracing_mode="fake")(torch.randn(1, 64), weight)

    gm = traced(torch.ones(64))
    found = match_rms_norm(_output_node(gm))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert found is not None and (found.x, found.weight, found.eps) == (placeholders[0], placeholders[1], 1e-6)
    assert match_rms_norm(_output_node(traced(torch.ones(1, 64)))) is None


# -- with coordinate-descent tuning: Inductor's decomposed one-row matmuls -------------------------

def _decomposed(f, *shapes, dtype=torch.float32):
    """``f`` traced as Inductor's decompositions leave it with coordinate-descent tuning on a GPU:
    on the meta device, which takes the GPU branch of ``decomposition.mm`` (CPU and MPS do not)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    args = [torch.empty(*s, dtype=dtype, device="meta") for s in shapes]
    with inductor_config.patch(coordinate_descent_tuning=True):
        return make_fx(f, decomposition_table=select_decomp_table())(*args)


def _three_projections(x, w_a, w_b, w_c):
    return x @ w_a.T, x @ w_b.T, x @ w_c.T


THREE = [(1, 256), (512, 256), (256, 256), (1024, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matcher_finds_inductors_decomposed_one_row_matmul(dtype):
    from tscompile.passes.matmul_nodes import decomposed_matmul

    gm = _decomposed(lambda x, w: x @ w.T, (1, 256), (512, 256), dtype=dtype)
    assert aten.mm.default not in _targets(gm) and aten.sum.dim_IntList in _targets(gm)  # decomposed
    found = [(n, decomposed_matmul(n)) for n in gm.graph.nodes if decomposed_matmul(n) is not None]
    assert len(found) == 1
    end, (x, transposed, chain) = found[0]
    assert end is chain[0] and end is next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert x.op == "placeholder" and x.name.startswith("x")
    assert transposed.target is aten.permute.default and transposed.args[0].name.startswith("w")
    # cast back to bf16 (and the two upcasts) only for a lower-precision dtype
    casts = sum(n.target is torch.ops.prims.convert_element_type.default for n in chain)
    assert casts == (0 if dtype == torch.float32 else 3)


def test_the_matcher_refuses_a_reduction_that_is_not_a_one_row_matmul():
    from tscompile.passes.matmul_nodes import decomposed_matmul

    def not_mm(x, w):  # the same ops, other dims: a sum over K of an outer product, not x @ w.T
        return (x.unsqueeze(2) * w.T.unsqueeze(0)).sum([2]), (x.unsqueeze(1) * w.unsqueeze(0)).sum([1])

    gm = make_fx(not_mm)(torch.randn(1, 8), torch.randn(8, 8))
    assert all(decomposed_matmul(n) is None for n in gm.graph.nodes)


def test_tuned_policy_puts_back_the_gemv_and_cublas_and_keeps_inductors_reduction(monkeypatch):
    """Policy {512x256: gemv, 256x256: cuBLAS}, 1024x256 unlisted: one ``tscompile::gemv``, one
    ``mm`` and one reduction left; the swapped graph computes the three products (run on the CPU)."""
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    from tscompile.passes.decode_gemv import swap_decomposed_matmuls

    gm = _decomposed(_three_projections, *THREE)
    assert swap_decomposed_matmuls(gm.graph, devices=("cuda",)) == 0  # a meta graph: not a listed device
    assert swap_decomposed_matmuls(gm.graph, devices=("meta",)) == 2
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(torch.ops.tscompile.gemv.default) == 1 and targets.count(aten.mm.default) == 1
    assert targets.count(aten.sum.dim_IntList) == 1 and targets.count(aten.mul.Tensor) == 1
    g = torch.Generator().manual_seed(7)
    args = [torch.randn(*s, generator=g) for s in THREE]
    x = args[0]
    out = gm(*args)  # fresh outputs (a functional graph allocates them), against fresh random inputs
    for got, w in zip(out, args[1:]):
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)


def test_tuned_policy_needs_a_launch_and_is_off_with_another_gpus_sweep(monkeypatch):
    from tscompile.passes.decode_gemv import swap_decomposed_matmuls

    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {})  # no launch for 512x256: Inductor keeps it
    assert swap_decomposed_matmuls(_decomposed(_three_projections, *THREE).graph, devices=("meta",)) == 1
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    monkeypatch.setattr(tg, "GEMV_TABLE_FILE", "a100.json")  # measured against the H200's kernels only
    assert tg.decode_tuned_matmuls() == {}
    assert swap_decomposed_matmuls(_decomposed(_three_projections, *THREE).graph, devices=("meta",)) == 0


def test_the_inductor_cache_key_follows_the_tuned_policy(monkeypatch):
    before = DecodeGemv().uuid()
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "cublas"})
    assert DecodeGemv().uuid() != before


def test_shipped_tuned_policy_names_known_choices_and_shapes_with_a_launch():
    assert set(tg.DECODE_TUNED_MATMULS.values()) <= set(tg.TUNED_CHOICES)
    for shape, choice in tg.DECODE_TUNED_MATMULS.items():
        if choice == "gemv":  # a gemv pick runs at the plain table's launch
            assert shape in tg.DECODE_GEMV_CONFIGS
        else:  # a cuBLAS pick is a shape the plain table leaves to cuBLAS too
            assert shape not in tg.DECODE_GEMV_CONFIGS


def test_a_tuned_engine_gives_the_eager_tokens_with_the_policys_kernels(monkeypatch):
    """The compiled CPU engine (llama-tiny, float32) with coordinate-descent tuning in its static bs=1
    decode graph, and Inductor's one-row ``mm`` decomposition made to apply on the CPU as it does on a
    GPU: the pass puts the policy's kernels back (qkv-shaped 512x256, which the LM head shares: the
    gemv op; the output projection: cuBLAS), gate/up stays Inductor's reduction, and the greedy
    tokens are the eager engine's."""
    from torch._inductor import decomposition

    from tscompile.passes.decode_gemv import swap_decomposed_matmuls

    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    params = tscompile.SamplingParams(max_new_tokens=4)
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:1], params))

    def one_row_mm_as_on_a_gpu(a, b, out_dtype=None):  # decomposition.mm's GPU branch
        if out_dtype is None and a.shape[0] == 1:
            return (a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)
        return NotImplemented

    # both tables Inductor may take (select_decomp_table): the plain one and its cached copy
    for table in (decomposition.decompositions, decomposition.fast_random_decomps()):
        monkeypatch.setitem(table, aten.mm.default, one_row_mm_as_on_a_gpu)
    seen = []

    class CpuDecodeGemv(DecodeGemv):
        def __call__(self, graph):
            reductions = sum(n.target is aten.sum.dim_IntList for n in graph.nodes)
            swapped = swap_decomposed_matmuls(graph, devices=("cpu",))
            seen.append((reductions, swapped, sum(n.target is aten.mm.default for n in graph.nodes),
                         sum(n.target is aten.sum.dim_IntList for n in graph.nodes)))

    real_patches = piece_compiler.piece_inductor_patches

    def patches_with_the_pass(config, static, **kw):
        patches = real_patches(config, static, **kw)
        if static:
            patches.update(post_grad_custom_post_pass=CpuDecodeGemv(), force_disable_caches=True)
        return patches

    calls, real_gemv = [], tg.gemv

    def counting_gemv(x, w, out=None, config=None, **fused):
        calls.append(tuple(w.shape))
        return real_gemv(x, w, out, config, **fused)

    monkeypatch.setattr(tg, "gemv", counting_gemv)
    monkeypatch.setattr(piece_compiler, "piece_inductor_patches", patches_with_the_pass)
    llm = small_llm(dtype=torch.float32, enforce_eager=False,
                    compile_options={"decode_ladder": (1,),
                                     "static_inductor_options": {"coordinate_descent_tuning": True}})
    got = ids(llm.generate(PROMPTS[:1], params))
    assert got == want
    layers = llm.runner.model.config.n_layers
    # per layer qkv, output, gate/up and down (256x512, unlisted) decomposed, and the LM head
    reductions, swapped, mms, left = seen[0]
    assert len(seen) == 1 and reductions == 4 * layers + 1
    assert swapped == 2 * layers + 1 and mms == layers  # qkv and the LM head: gemv; output: cuBLAS
    assert left == reductions - swapped
    assert calls and set(calls) == {(512, 256)}  # the op ran inside the graph's steps, for that shape only
