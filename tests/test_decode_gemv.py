"""passes/decode_gemv.py: the bs=1 decode graph's one-row projections through ``tscompile::gemv``,
and the kernel choices of ``KernelPolicy`` as ``piece_compiler`` applies them to a graph's patches.

The pass acts on CUDA graphs only (on by default on the GPUs its table was timed on; off with
``KernelPolicy.decode_gemv=False``); here it runs on CPU graphs by naming the CPU device (the op's
Triton kernel runs under the interpreter, which conftest turns on), with llama-tiny's weight shapes
put in the launch table."""

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
from tscompile.kernel_policy import KernelPolicy
from tscompile.passes.batch_gemv import BatchGemv
from tscompile.passes.decode_gemv import DecodeGemv, swap_decode_gemvs

from helpers import PROMPTS, ids, our_pass, small_llm

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


@pytest.mark.parametrize("pdl", [False, True])
def test_the_pass_asks_each_call_for_pdl_as_told(monkeypatch, pdl):
    """``pdl`` (the graph's Inductor kernels launch with PDL): every swapped call, plain or with the
    residual added after it, carries ``pdl=True`` and hands it to the kernel; without it no call asks."""
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
    assert swap_decode_gemvs(gm.graph, devices=("cpu",), pdl=pdl) == 2
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


def test_the_op_runs_each_shape_at_its_listed_launch(monkeypatch):
    """``tscompile::gemv``: a listed weight shape at its DECODE_GEMV_CONFIGS launch, any other at the
    kernel's default one; the product is right either way (fresh random inputs, NaN-poisoned out)."""
    seen, real = [], tg.gemv
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {(24, 48): (8, 16, 1, 4, 1, "acc")})
    monkeypatch.setattr(tg, "gemv", lambda x, w, out=None, config=None, **kw: seen.append(config) or real(x, w, out, config, **kw))
    g = torch.Generator().manual_seed(3)
    for n in (24, 16):
        x, w = torch.randn(1, 48, generator=g), torch.randn(n, 48, generator=g)
        torch.testing.assert_close(torch.ops.tscompile.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    assert seen == [(8, 16, 1, 4, 1, "acc"), None]


def test_the_inductor_cache_key_follows_the_launch_table(monkeypatch):
    """Which matmuls the pass swaps, and how, depends on the table and ``pdl``: a graph compiled under
    one must not be reused from Inductor's cache under another."""
    keys = [DecodeGemv().uuid()]
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    keys.append(DecodeGemv().uuid())
    keys.append(DecodeGemv(pdl=True).uuid())
    assert len(set(keys)) == 3
    assert DecodeGemv().uuid() == keys[1]


def _patches(monkeypatch, policy: KernelPolicy, *, available=True, static, split_piece, user=None, engine=True,
             gpu="NVIDIA H200", device="cuda", user_pass=None) -> dict:
    """The Inductor patches of one graph under ``policy`` on a GPU named ``gpu``, ``available``
    standing in for the GPU's PDL, ``user``: the user's ``triton.enable_pdl`` (None: unset),
    ``user_pass``: the user's own post-grad pass; ``engine``: compiled as the engine's own step."""
    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": available)
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: gpu)
    options = {} if user is None else {"triton.enable_pdl": user}
    if user_pass is not None:
        options["post_grad_custom_post_pass"] = user_pass
    config = TscompileConfig(inductor_options=options, kernels=policy)
    with piece_compiler.engine_graphs() if engine else contextlib.nullcontext():
        return piece_compiler.piece_inductor_patches(config, static, device_type=device, split_piece=split_piece,
                                                     cudagraph_trees=False)


@pytest.mark.parametrize("decode_pdl, available, static, split_piece, user, wanted", [
    (True, True, True, False, None, True),      # the default: the bs=1 decode graph on a GPU with PDL
    (True, True, False, False, None, True),     # and the dynamic-batch decode graph
    (False, True, True, False, None, False),    # decode_pdl=False: neither
    (False, True, False, False, None, False),
    (True, False, True, False, None, False),    # before Hopper
    (True, True, True, True, None, False),      # a prefill piece: prefill_pdl's (off)
    (True, True, True, False, False, False),    # the user's option wins
])
def test_decode_pdl_gives_the_decode_graphs_inductors_pdl_and_the_gemv_kernels_pdl(
        monkeypatch, decode_pdl, available, static, split_piece, user, wanted):
    """``KernelPolicy.decode_pdl``: Inductor's ``triton.enable_pdl`` in every decode graph, and the GEMV
    kernels the passes put there launch with PDL exactly where the graph's kernels do."""
    patches = _patches(monkeypatch, KernelPolicy(decode_pdl=decode_pdl), available=available, static=static,
                       split_piece=split_piece, user=user)
    assert patches.get("triton.enable_pdl", False) is wanted
    assert patches.get("combo_kernels", False) is (static or split_piece)  # the other CUDA defaults stay
    if not split_piece:  # the GEMV pass of either decode graph: its kernels follow the graph's PDL
        swap = our_pass(patches, DecodeGemv if static else BatchGemv)
        assert swap is not None and swap.pdl is wanted


@pytest.mark.parametrize("prefill_pdl, available, user, wanted", [
    (True, True, None, True),      # a prefill piece with prefill_pdl
    (False, True, None, False),    # off by default
    (True, False, None, False),    # before Hopper
    (True, True, False, False),    # the user's option wins
])
def test_prefill_pdl_gives_the_prefill_pieces_inductors_pdl(monkeypatch, prefill_pdl, available, user, wanted):
    patches = _patches(monkeypatch, KernelPolicy(prefill_pdl=prefill_pdl), available=available, static=False,
                       split_piece=True, user=user)
    assert patches.get("triton.enable_pdl", False) is wanted


def test_the_default_policy_is_the_measured_one():
    """The defaults the switches had: both GEMV swaps on, PDL in decode graphs, not in prefill."""
    assert KernelPolicy() == KernelPolicy(decode_gemv=True, batch_gemv=True, decode_pdl=True, prefill_pdl=False)
    assert TscompileConfig().kernels == KernelPolicy()


@pytest.mark.parametrize("user", [None, True])
def test_a_torch_compile_users_graphs_get_pdl_only_when_asked(monkeypatch, user):
    """Outside the engine's own step (``piece_compiler.engine_graphs``) no graph gets Inductor's PDL
    unasked, whatever the policy; asked for, the decode GEMV pass's kernels launch with it too."""
    for static, split_piece in ((True, False), (False, False), (False, True)):
        patches = _patches(monkeypatch, KernelPolicy(prefill_pdl=True), static=static, split_piece=split_piece,
                           user=user, engine=False)
        assert patches.get("triton.enable_pdl", False) is bool(user)
        if static:
            assert our_pass(patches, DecodeGemv).pdl is bool(user)


@pytest.mark.parametrize("decode_gemv, static, device, gpu, user_pass, wanted", [
    (True, True, "cuda", "NVIDIA H200", None, True),            # on by default, where its table was timed
    (False, True, "cuda", "NVIDIA H200", None, False),          # decode_gemv=False
    (True, True, "cuda", "NVIDIA A100-SXM4-80GB", None, False),  # another GPU: its launches are untimed there
    (True, False, "cuda", "NVIDIA H200", None, False),          # a dynamic-batch graph: its matmuls are not one-row
    (True, True, "cpu", "", None, False),
    (True, True, "cuda", "NVIDIA H200", "mine", False),         # the user's own post-grad pass wins
])
def test_only_static_cuda_graphs_on_a_timed_gpu_get_the_pass(monkeypatch, decode_gemv, static, device, gpu,
                                                              user_pass, wanted):
    patches = _patches(monkeypatch, KernelPolicy(decode_gemv=decode_gemv), static=static, split_piece=False,
                       gpu=gpu, device=device, user_pass=user_pass)
    assert (our_pass(patches, DecodeGemv) is not None) == wanted


def test_an_engine_with_the_pass_gives_the_eager_tokens_and_runs_the_op(monkeypatch):
    """The compiled CPU engine (llama-tiny, float32) with the pass in its static bs=1 decode graph:
    the eager engine's greedy tokens, and the op ran inside that graph's steps for exactly the listed
    shapes (llama-tiny's LM head has its qkv's shape, 512 x 256, so it is swapped too)."""
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    params = tscompile.SamplingParams(max_new_tokens=4)
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:1], params))

    class CpuDecodeGemv(DecodeGemv):
        def __call__(self, graph):
            swapped.append(swap_decode_gemvs(graph, devices=("cpu",)))

    swapped, calls = [], []
    real_patches, real_gemv = piece_compiler.piece_inductor_patches, tg.gemv

    def patches_with_the_pass(config, static, **kw):
        patches = real_patches(config, static, **kw)
        if static:  # compiled, not loaded from the cache, so the pass runs; other graphs may hit it
            patches.update(post_grad_custom_post_pass=CpuDecodeGemv(), force_disable_caches=True)
        return patches

    def counting_gemv(x, w, out=None, config=None, **kw):
        calls.append((tuple(w.shape), config))
        return real_gemv(x, w, out, config, **kw)

    monkeypatch.setattr(piece_compiler, "piece_inductor_patches", patches_with_the_pass)
    monkeypatch.setattr(tg, "gemv", counting_gemv)
    llm = small_llm(dtype=torch.float32, enforce_eager=False, compile_options={"decode_ladder": (1,)})
    got = ids(llm.generate(PROMPTS[:1], params))
    assert got == want
    layers = llm.runner.model.config.n_layers
    assert swapped == [3 * layers + 1]  # one static graph: qkv, output and gate/up of each layer, the LM head
    assert {shape for shape, _ in calls} == set(TINY_TABLE)
    assert all(config == TINY_TABLE[shape] for shape, config in calls)


def test_a_bench_run_records_the_kernel_choices_and_launch_tables_it_ran_with(monkeypatch):
    """A run's kernel_paths: each policy choice as it applies on this machine, and with a GEMV swap on
    its table (which projections left cuBLAS and at which launch); with the swaps off, no table."""
    from tscompile.bench import environment

    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": False)
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA H200")
    off = KernelPolicy(decode_gemv=False, batch_gemv=False)
    assert environment.kernel_paths(off) == {"fuse_projections": False, "chunked_gated_delta": False,
                                             "fused_gated_delta": True, "split_gated_delta_heads": False,
                                             "user_graph_eager_tail": False,
                                             "decode_gemv": False, "batch_gemv": False,
                                             "decode_pdl": False, "prefill_pdl": False, "state_pdl": False}
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", TINY_TABLE)
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(32, 512, 256): (64, 128, 1, 4, 4, "dot")})
    paths = environment.kernel_paths()
    assert paths["decode_gemv"] is True and paths["batch_gemv"] is True
    assert paths["decode_gemv_configs"] == {f"{n}x{k}": list(c) for (n, k), c in TINY_TABLE.items()}
    assert paths["decode_tuned_matmuls"] == {"512x256": "gemv", "256x256": "cublas"}
    assert paths["batch_gemv_configs"] == {"32x512x256": [64, 128, 1, 4, 4, "dot"]}
    monkeypatch.setattr(ta, "pdl_available", lambda device="cuda": True)
    assert environment.kernel_paths()["decode_pdl"] is True and environment.kernel_paths()["prefill_pdl"] is False
    assert environment.kernel_paths(KernelPolicy(decode_pdl=False, prefill_pdl=True))["prefill_pdl"] is True
    monkeypatch.setattr(piece_compiler, "cuda_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    paths = environment.kernel_paths()  # on, but not the GPU the tables were timed on: no swap, no table
    assert paths["decode_gemv"] is False and paths["batch_gemv"] is False and "batch_gemv_configs" not in paths


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


def test_tuned_policy_needs_a_launch(monkeypatch):
    from tscompile.passes.decode_gemv import swap_decomposed_matmuls

    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {})  # no launch for 512x256: Inductor keeps it
    assert swap_decomposed_matmuls(_decomposed(_three_projections, *THREE).graph, devices=("meta",)) == 1


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

    def counting_gemv(x, w, out=None, config=None, **kw):
        calls.append(tuple(w.shape))
        return real_gemv(x, w, out, config, **kw)

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
