"""Projections that read one input, packed side by side at load (``models/hf_packing.py``) and run as
one matmul by the post-grad pass (``passes/fused_projections.py``): the packing keeps every value, the
pass fuses exactly the runs whose weights lie end to end and keeps the outputs, in each matmul form,
and a transformers model on the compiled engine keeps transformers' tokens with fewer matmuls."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import tscompile
from tscompile import piece_compiler
from tscompile.kernel_policy import KernelPolicy
from tscompile.models.hf_packing import pack_projections, shared_input_projections
from tscompile.passes.fused_projections import FuseProjections, fuse_projections

aten = torch.ops.aten
prims = torch.ops.prims
MATMULS = (aten.mm.default, aten.addmm.default)


class Block(nn.Module):
    """q/k/v of one input, gate/up of another, an output projection of its own input."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 24, bias=bias), nn.Linear(32, 8, bias=bias), nn.Linear(32, 8, bias=bias)
        self.gate, self.up = nn.Linear(24, 40, bias=False), nn.Linear(24, 40, bias=False)
        self.out = nn.Linear(40, 32, bias=False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = q * torch.cat([k, v, k], -1)
        return self.out(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class CountingPass(FuseProjections):
    """The pass, recording the graph's (matmuls before, matmuls after)."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        before = sum(n.target in MATMULS for n in graph.nodes)
        super().__call__(graph)
        self.seen.append((before, sum(n.target in MATMULS for n in graph.nodes)))


def _compiled(module, counting: CountingPass, dynamic: bool = False):
    torch._dynamo.reset()
    # the FX graph cache would hand back an earlier compile without running the pass
    return torch.compile(module, dynamic=dynamic,
                         options={"post_grad_custom_post_pass": counting, "fx_graph_cache": False})


def _storage_offsets(modules, attr="weight"):
    tensors = [getattr(m, attr) for m in modules]
    return {t.untyped_storage().data_ptr() for t in tensors}, [t.storage_offset() for t in tensors]


@pytest.mark.parametrize("bias", [False, True], ids=["mm", "bias-addmm"])
def test_packing_finds_the_groups_keeps_every_value_and_lays_the_weights_end_to_end(bias):
    torch.manual_seed(0)
    block, x = Block(bias), torch.randn(5, 32)
    want = block(x).detach()
    groups = shared_input_projections(block, lambda: block(x))
    assert groups == [["q", "k", "v"], ["gate", "up"]]  # "out" reads a tensor of its own
    assert pack_projections(block, groups) == 2
    assert torch.equal(block(x), want)
    ptrs, offsets = _storage_offsets([block.q, block.k, block.v])
    assert len(ptrs) == 1 and offsets == [0, 24 * 32, 32 * 32]
    if bias:
        ptrs, offsets = _storage_offsets([block.q, block.k, block.v], "bias")
        assert len(ptrs) == 1 and offsets == [0, 24, 32]
    ptrs, offsets = _storage_offsets([block.gate, block.up])
    assert len(ptrs) == 1 and offsets == [0, 40 * 24]
    assert isinstance(block.q.weight, nn.Parameter) and block.out.weight.storage_offset() == 0


def test_a_tied_weight_or_a_mixed_group_is_not_packed():
    torch.manual_seed(0)
    block, x = Block(False), torch.randn(3, 32)
    block.k.weight = nn.Parameter(torch.randn(8, 32))
    block.v.weight = block.k.weight  # shared with another module: it cannot move into q's buffer alone
    block.up.bias = nn.Parameter(torch.randn(40))  # gate has no bias: one buffer cannot hold both
    assert shared_input_projections(block, lambda: block(x)) == []


@pytest.mark.parametrize("bias", [False, True], ids=["mm", "bias-addmm"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-rows"])
def test_the_pass_runs_each_packed_group_as_one_matmul_with_the_same_outputs(bias, dynamic):
    torch.manual_seed(1)
    block = Block(bias)
    pack_projections(block, shared_input_projections(block, lambda: block(torch.randn(2, 32))))
    counting = CountingPass()
    compiled = _compiled(block, counting, dynamic)
    with torch.no_grad():
        for rows in (3, 7):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-6)
    # q/k/v: 3 -> 1, gate/up: 2 -> 1, out stays
    assert counting.seen and set(counting.seen) == {(6, 3)}


def test_weights_not_side_by_side_are_left_alone():
    torch.manual_seed(2)
    block = Block(True)
    counting = CountingPass()
    with torch.no_grad():
        x = torch.randn(4, 32)
        torch.testing.assert_close(_compiled(block, counting)(x), block(x), rtol=1e-5, atol=1e-6)
    assert counting.seen == [(6, 6)]


def _decomposed_projections(x, wq, wk):
    """Inductor's one-row ``mm`` decomposition (coordinate-descent tuning on CUDA), written out: two
    projections of ``x``, bfloat16 in and out, float32 products and sum."""
    outs = []
    for w in (wq, wk):
        xc = prims.convert_element_type.default(x, torch.float32)
        wt = prims.convert_element_type.default(aten.permute.default(w, [1, 0]), torch.float32)
        prod = aten.mul.Tensor(aten.unsqueeze.default(xc, 2), aten.unsqueeze.default(wt, 0))
        outs.append(prims.convert_element_type.default(aten.sum.dim_IntList(prod, [1]), torch.bfloat16))
    return outs[0] * 2 + outs[1][:, :1]


def test_the_decomposed_one_row_form_is_fused_into_the_same_form():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(12, 16, generator=gen).bfloat16()
    wq, wk = base[:8], base[8:]
    gm = make_fx(_decomposed_projections, tracing_mode="fake")(torch.randn(1, 16).bfloat16(), wq, wk)
    sums = lambda: sum(n.target is aten.sum.dim_IntList for n in gm.graph.nodes)  # noqa: E731
    assert sums() == 2
    assert fuse_projections(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert sums() == 1
    for _ in range(3):
        x = torch.randn(1, 16, generator=gen).bfloat16()
        assert torch.equal(gm(x, wq, wk), _decomposed_projections(x, wq, wk))  # same products, same sums


def test_the_policy_puts_the_pass_first_in_every_cuda_graph_when_on_and_leaves_it_out_by_default():
    for static, split in ((True, False), (False, False), (False, True)):
        on = piece_compiler.our_post_grad_passes(KernelPolicy(fuse_projections=True), static, split, True, False,
                                                 "NVIDIA H200")
        assert isinstance(on[0], FuseProjections) and len(on) > 1
        off = piece_compiler.our_post_grad_passes(KernelPolicy(), static, split, True, False, "NVIDIA H200")
        assert not any(isinstance(p, FuseProjections) for p in off)
    with pytest.raises(ValueError, match=r"^tscompile: kernels.fuse_projections must be True or False"):
        KernelPolicy(fuse_projections="yes")


def test_a_transformers_model_on_the_compiled_engine_fuses_and_keeps_transformers_tokens(tmp_path):
    """Qwen3 through the transformers backend: the load packs q/k/v and gate/up of every layer; the
    compiled engine (Inductor, the pass set as on CUDA) runs each as one matmul, in the decode graph
    and in the prefill pieces, and gives transformers' greedy tokens in float32."""
    from test_transformers_backend import PROMPTS, _write, generate, hf_greedy

    hf = _write("qwen3", tmp_path, 0)
    counting = CountingPass()
    llm = tscompile.LLM(str(tmp_path), device="cpu", attention_backend="torch", page_size=4, max_model_len=64,
                        max_num_seqs=4, model_impl="transformers", enforce_eager=False,
                        compile_options={"inductor_options": {"post_grad_custom_post_pass": counting,
                                                              "fx_graph_cache": False}})
    layer = llm.runner.model.hf_model.model.layers[0]
    ptrs, offsets = _storage_offsets([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
    assert len(ptrs) == 1 and offsets[1] == layer.self_attn.q_proj.weight.numel()
    assert generate(llm, PROMPTS[:3]) == [hf_greedy(hf, p) for p in PROMPTS[:3]]
    # every graph lost two matmuls per layer it holds both groups of (q/k/v 3 -> 1, gate/up 2 -> 1)
    layers = hf.config.num_hidden_layers
    decode = [s for s in counting.seen if s[0] == 7 * layers + 1]  # the whole decode step: 7 per layer + head
    assert decode and all(after == before - 3 * layers for before, after in decode)
    assert sum(before - after for before, after in counting.seen) > len(decode) * 3 * layers  # the pieces too
