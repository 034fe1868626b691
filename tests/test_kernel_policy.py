"""``KernelPolicy`` reaches the kernels per engine: the attention leaves' impl name carries the PDL
choices to the Triton kernels (an op argument, so graphs and exported programs record it), and two
routers built with different policies in one process launch differently. The passes' side (which
graph gets which pass) is in test_decode_gemv.py and test_batch_gemv.py."""

from __future__ import annotations

import pytest
import torch

from tscompile.attention import create_attention_router
from tscompile.custom_ops import attention_impls
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops import triton_extend as te
from tscompile.kernel_policy import KernelPolicy
from tscompile.kv_cache.spec import CacheGroupSpec

from helpers import random_paged_batch, run_attention

SCALE = 0.25


@pytest.mark.parametrize("policy, name", [
    (KernelPolicy(), "triton"),
    (KernelPolicy(decode_pdl=False), "triton/decode_pdl=0"),
    (KernelPolicy(prefill_pdl=True), "triton/prefill_pdl=1"),
    (KernelPolicy(decode_pdl=False, prefill_pdl=True), "triton/decode_pdl=0,prefill_pdl=1"),
    (KernelPolicy(decode_gemv=False, batch_gemv=False), "triton"),  # no attention choice among these
    (KernelPolicy(fused_verify_attention=True), "triton/fused_verify=1"),
    (KernelPolicy(decode_pdl=False, fused_verify_attention=True), "triton/decode_pdl=0,fused_verify=1"),
])
def test_each_policy_names_a_registered_triton_impl(policy, name):
    assert ta.attention_impl_name(policy.decode_pdl, policy.prefill_pdl, policy.fused_verify_attention) == name
    assert name in attention_impls()


def test_two_routers_in_one_process_carry_their_own_policy_to_their_leaves():
    spec = [CacheGroupSpec("full", (0, 1), 2, 16), CacheGroupSpec("full", (2,), 2, 16)]
    kw = dict(max_model_len=32, page_size=4, pages_per_block=1, device="cpu")
    default = create_attention_router("triton", spec, **kw)
    plain = create_attention_router("triton", spec, kernels=KernelPolicy(decode_pdl=False), **kw)
    assert [leaf.impl for leaf in default.child_backends()] == ["triton", "triton"]
    assert [leaf.impl for leaf in plain.child_backends()] == ["triton/decode_pdl=0"] * 2
    torch_router = create_attention_router("torch", spec, kernels=KernelPolicy(decode_pdl=False), **kw)
    assert {leaf.impl for leaf in torch_router.child_backends()} == {"torch"}  # no choices to carry


@pytest.mark.parametrize("impl, decode_pdl, prefill_pdl", [
    ("triton", True, False), ("triton/decode_pdl=0", False, False), ("triton/prefill_pdl=1", True, True),
])
def test_the_impl_name_decides_which_launches_ask_for_pdl(impl, decode_pdl, prefill_pdl, monkeypatch, device):
    """Through the op's body: a decode asks ``pdl_launch`` for the split and combine kernels with the
    name's ``decode_pdl``, an extend (the dense kernel) with its ``prefill_pdl``; the outputs match the
    torch oracle (fresh random inputs; outputs NaN-poisoned by ``run_attention``)."""
    monkeypatch.setattr(ta, "FAST_EXTEND_HEAD_DIMS", frozenset({16}))  # the dense kernel at a tiny head_dim
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", 16)  # several splits: the combine runs too
    monkeypatch.setattr(ta, "DECODE_BLOCK_N", 16)
    asked = []
    for module in (ta, te):
        real = module.pdl_launch
        monkeypatch.setattr(module, "pdl_launch", lambda device, pdl, real=real: asked.append(pdl) or real(device, pdl))
    for decode, q_lens, kv_lens in ((True, [1, 1], [40, 9]), (False, [5, 3], [9, 3])):
        batch = random_paged_batch(q_lens, kv_lens, page_size=4, num_kv_heads=2, group=2, head_dim=16, seed=len(asked))
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        asked.clear()
        out, k_cache, v_cache = run_attention(batch, impl, decode=decode, scale=SCALE)
        ref, k_ref, v_ref = run_attention(batch, "torch", decode=decode, scale=SCALE)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        want = decode_pdl if decode else prefill_pdl
        assert asked and set(asked) == {want}, (decode, asked)
