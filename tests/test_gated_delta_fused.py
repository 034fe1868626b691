"""``tscompile::gated_delta_fused`` (the gates, the gated delta rule and the gated RMSNorm of a
linear-attention layer as one op) against transformers' own delta rule and gated norm in float32,
on random data with fresh inputs per check, NaN-poisoned outputs and untouched slots compared bit
for bit; the Triton kernel runs under the interpreter on the CPU.
"""

import dataclasses

import pytest
import torch

from tscompile.custom_ops.gated_delta_fused import gated_rms_norm, gates

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

# (impl, value_blocks): the Triton kernel with a program per head and with each head split over programs
SPLITS = [("torch", 1), ("triton", 1), ("triton", 4), ("triton/pdl", 1), ("triton/pdl", 2)]


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def _case(seed, lengths, fresh, hk=2, hv=4, dk=16, dv=16, num_slots=8):
    """Packed rows of ``lengths`` requests: the layer's projections (q, k, v, raw a and b, z), its
    parameters (A_log, dt_bias, the norm's weight), a random state pool and the requests' slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = {"q": torch.randn(total, hk, dk, generator=gen), "k": torch.randn(total, hk, dk, generator=gen),
         "v": torch.randn(total, hv, dv, generator=gen), "a": torch.randn(total, hv, generator=gen),
         "b": torch.randn(total, hv, generator=gen), "z": torch.randn(total, hv, dv, generator=gen),
         "a_log": (1 + 15 * torch.rand(hv, generator=gen)).log(), "dt_bias": 1 + 0.5 * torch.randn(hv, generator=gen),
         "norm_weight": 1 + 0.3 * torch.randn(dv, generator=gen),
         "pool": torch.randn(num_slots, hv, dk, dv, generator=gen),
         "slots": torch.randperm(num_slots - 1, generator=gen)[:len(lengths)] + 1,  # slot 0 is the null slot
         "cu": torch.tensor([0] + lengths).cumsum(0).to(torch.int32), "has_state": torch.tensor([not f for f in fresh])}
    return t


def _hf_request(t, lo, hi, start):
    """transformers' recurrent delta rule and gated norm over rows ``[lo, hi)`` of one request."""
    g, beta = gates(t["a"][lo:hi], t["b"][lo:hi], t["a_log"], t["dt_bias"])
    group = t["v"].shape[1] // t["q"].shape[1]
    q, k = (t[n][lo:hi].repeat_interleave(group, dim=1)[None] for n in ("q", "k"))
    core, state = qwen3_next.torch_recurrent_gated_delta_rule(
        q, k, t["v"][lo:hi][None], g[None], beta[None], initial_state=None if start is None else start[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    norm = qwen3_next.Qwen3NextRMSNormGated(t["v"].shape[2], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(t["norm_weight"])
        return norm(core[0], t["z"][lo:hi]), state[0]


def _run(t, impl, device, rows=None, checkpoints=None, value_blocks=1):
    rows = t["q"].shape[0] if rows is None else rows
    out = torch.full_like(t["v"][:rows], float("nan"))
    args = _on(device, t["q"][:rows], t["k"][:rows], t["v"][:rows], t["a"][:rows], t["b"][:rows], t["a_log"],
               t["dt_bias"], t["z"][:rows], t["norm_weight"])
    pool, out, slots, cu, has_state = _on(device, t["pool"].clone(), out, t["slots"], t["cu"], t["has_state"])
    ckpt = None if checkpoints is None else checkpoints.to(device)
    torch.ops.tscompile.gated_delta_fused(*args, 1e-6, pool, slots, cu, has_state, out, impl, True, ckpt, value_blocks)
    return out.cpu(), pool.cpu(), None if ckpt is None else ckpt.cpu()


@pytest.mark.parametrize("impl,value_blocks", SPLITS)
@pytest.mark.parametrize("lengths,fresh", [([1, 1, 1], [False, False, False]),  # a decode step
                                           ([4, 4], [False, True]),  # verify windows
                                           ([5, 1, 12], [True, False, False])])
# 12: the norm over a masked tile (split in 4, the last program's columns are all masked)
@pytest.mark.parametrize("dv", [16, 12], ids=["dv16", "dv12"])
def test_fused_op_equals_transformers_delta_rule_and_gated_norm(impl, value_blocks, lengths, fresh, dv, device):
    t = _case(sum(lengths) * 11 + len(impl) + dv + value_blocks, lengths, fresh, dv=dv)
    out, pool, _ = _run(t, impl, device, value_blocks=value_blocks)
    bounds = t["cu"].tolist()
    for r, slot in enumerate(t["slots"].tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        want_out, want_state = _hf_request(t, lo, hi, None if fresh[r] else t["pool"][slot])
        torch.testing.assert_close(out[lo:hi], want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], want_state, rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(pool.shape[0]) if s not in t["slots"].tolist()]
    assert torch.equal(pool[untouched], t["pool"][untouched])


@pytest.mark.parametrize("impl,value_blocks", SPLITS)
def test_fused_op_equals_the_three_ops_it_replaces(impl, value_blocks, device):
    """The model's unfused path (its ``gates``, ``tscompile::gated_delta_rule``, ``gated_rms_norm``)
    and the fused op: the same outputs and states, and the same checkpoints of a verify window."""
    lengths, fresh = [4, 4, 4], [False, True, False]
    t = _case(97 + len(impl) + value_blocks, lengths, fresh)
    ckpt = torch.full((3, 3, *t["pool"].shape[1:]), float("nan"))
    out, pool, fused_ckpt = _run(t, impl, device, checkpoints=ckpt, value_blocks=value_blocks)

    g, beta = gates(t["a"], t["b"], t["a_log"], t["dt_bias"])
    core = torch.full_like(t["v"], float("nan"))
    want_pool, want_ckpt = t["pool"].clone(), ckpt.clone()
    args = _on(device, t["q"], t["k"], t["v"], g, beta, want_pool, t["slots"], t["cu"], t["has_state"], core, want_ckpt)
    torch.ops.tscompile.gated_delta_rule(*args[:10], impl, True, 0 if impl != "torch" else 8, args[10])
    want_out = gated_rms_norm(args[9].cpu(), t["z"], t["norm_weight"], 1e-6)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, args[5].cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_ckpt, args[10].cpu(), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert not torch.isnan(fused_ckpt[:, :3]).any()  # each request's 3 entries (4 rows but the last) written


@pytest.mark.parametrize("impl,value_blocks", SPLITS)
@pytest.mark.parametrize("padding", ["prefill", "decode"])
def test_padded_requests_and_rows_touch_only_the_null_slot(impl, value_blocks, padding, device):
    """A prefill graph's bucket pads requests (null slot 0, an empty row range, a fresh state) and
    rows past the last request's; a decode graph's pads requests of one row each, all on the null
    slot at once. The live requests get what an unpadded call gives, no slot but the live ones and
    the null slot changes, and in a prefill bucket no padded row is written."""
    lengths, fresh = [1, 1, 1], [False, False, True]
    t = _case(5 + len(impl) + value_blocks, lengths, fresh)
    want_out, want_pool, _ = _run(t, impl, device, value_blocks=value_blocks)
    pad_rows, pad_requests = (5, 2) if padding == "prefill" else (3, 3)
    padded = dict(t)
    for name in ("q", "k", "v", "a", "b", "z"):
        padded[name] = torch.cat([t[name], torch.randn(pad_rows, *t[name].shape[1:])])
    padded["slots"] = torch.cat([t["slots"], torch.zeros(pad_requests, dtype=t["slots"].dtype)])
    pad_ends = t["cu"][-1:].repeat(pad_requests)
    if padding == "decode":
        pad_ends = pad_ends + torch.arange(1, pad_requests + 1, dtype=pad_ends.dtype)
    padded["cu"] = torch.cat([t["cu"], pad_ends])
    padded["has_state"] = torch.cat([t["has_state"], torch.zeros(pad_requests, dtype=torch.bool)])
    out, pool, _ = _run(padded, impl, device, value_blocks=value_blocks)
    live = sum(lengths)
    # close, not equal: the CPU's vectorized and scalar exp round differently at other lengths
    torch.testing.assert_close(out[:live], want_out, rtol=1e-6, atol=1e-6)
    assert torch.isnan(out[live:]).all() if padding == "prefill" else torch.isfinite(out[live:]).all()
    torch.testing.assert_close(pool[1:], want_pool[1:], rtol=1e-6, atol=1e-6)


def test_opcheck_fused_op():
    t = _case(3, [2, 1], [True, False])
    out = torch.empty_like(t["v"])
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["a_log"], t["dt_bias"], t["z"], t["norm_weight"], 1e-6,
            t["pool"].clone(), t["slots"], t["cu"], t["has_state"], out, "torch", True, None)
    torch.library.opcheck(torch.ops.tscompile.gated_delta_fused.default, args)


def test_unknown_impl_and_misshapen_checkpoints_are_refused():
    t = _case(4, [2, 2], [True, True])
    out = torch.empty_like(t["v"])
    args = [t["q"], t["k"], t["v"], t["a"], t["b"], t["a_log"], t["dt_bias"], t["z"], t["norm_weight"], 1e-6,
            t["pool"], t["slots"], t["cu"], t["has_state"], out]
    with pytest.raises(ValueError, match=r"^tscompile: state kernel impl 'cuda' is unknown"):
        torch.ops.tscompile.gated_delta_fused(*args, "cuda", True, None)
    with pytest.raises(ValueError, match=r"^tscompile: gated_delta_fused checkpoints \(2, 1, 4, 16, 8\)"):
        torch.ops.tscompile.gated_delta_fused(*args, "torch", True, torch.zeros(2, 1, 4, 16, 8))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_decay_inputs_far_below_zero_keep_their_softplus(impl, device):
    """``a + dt_bias`` from -40 to 30 with a large ``A``: torch's softplus is ``log1p(exp(x))`` below 20
    and ``x`` past it; the kernel's gives the same decays where ``log(1 + exp(x))`` would lose the low
    bits of ``exp(x)`` (or all of them, below about -17)."""
    t = _case(61, [6, 6], [False, False])
    t["dt_bias"] = torch.zeros_like(t["dt_bias"])
    t["a_log"] = torch.full_like(t["a_log"], 12.0)  # A = exp(12): a softplus of 1e-7 still decays visibly
    t["a"] = torch.linspace(-40, 30, 48).reshape(12, 4)
    out, pool, _ = _run(t, impl, device)
    bounds = t["cu"].tolist()
    for r, slot in enumerate(t["slots"].tolist()):
        want_out, want_state = _hf_request(t, bounds[r], bounds[r + 1], t["pool"][slot])
        torch.testing.assert_close(out[bounds[r]:bounds[r + 1]], want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], want_state, rtol=1e-4, atol=1e-4)


def test_heads_past_the_register_tile_take_the_three_ops():
    """The Triton op refuses a head it cannot hold; a model with such heads binds its layers to the
    three ops even where the policy asks for the fused one."""
    from tscompile.custom_ops.gated_delta_fused import fused_head_fits
    from tscompile.kv_cache.state_pool import StatePool
    from tscompile.models.qwen3_next import QWEN3_NEXT_PRESETS, Qwen3NextTransformer

    assert fused_head_fits(128, 128) and fused_head_fits(100, 128) and not fused_head_fits(256, 128)
    t = _case(2, [1], [False], dk=256, dv=128)
    with pytest.raises(ValueError, match=r"^tscompile: gated_delta_fused holds a value head's \[256, 128\] state"):
        _run(t, "triton", "cpu")
    for dk, dv, fused in ((32, 32, True), (256, 128, False)):
        cfg = dataclasses.replace(QWEN3_NEXT_PRESETS["qwen3-next-tiny"], linear_key_head_dim=dk,
                                  linear_value_head_dim=dv)
        model = Qwen3NextTransformer(cfg)
        model.bind_state_pool(StatePool.allocate(model.state_spec(), 2, "cpu"), "torch", fused_decode=True)
        assert {layer.linear_attn.fused_decode for layer in model.layers if layer.linear} == {fused}


def test_value_blocks_that_do_not_tile_a_head_are_refused():
    t = _case(8, [1], [False], dv=16)
    for blocks in (0, 3, 32):
        with pytest.raises(ValueError, match=rf"^tscompile: gated_delta_fused value_blocks {blocks} must be a power "
                                             r"of two from 1 to the head's padded value width 16"):
            _run(t, "triton", "cpu", value_blocks=blocks)


def test_split_heads_leave_their_arrival_counters_at_zero(monkeypatch, device):
    """Each split launch counts every program of a head in and the last one resets the counter, so
    the next launch (a graph's next replay) starts from zero; a launch with no counters to take
    (more heads than counters) runs a program per head and gives the same result."""
    import tscompile.custom_ops.triton_gemv as tg

    monkeypatch.setattr(tg, "_ARRIVALS", {})
    t = _case(23, [1, 3, 1], [False, False, True])
    split, split_pool, _ = _run(t, "triton", device, value_blocks=4)
    dev = torch.device(device)
    index = torch.cuda.current_device() if dev.type == "cuda" else dev.index  # the launch's device carries its index
    counters = tg._ARRIVALS[("gated_delta", dev.type, index)]
    assert int(counters.abs().sum()) == 0
    again, _, _ = _run(t, "triton", device, value_blocks=4)
    assert torch.equal(again, split)
    monkeypatch.setattr(tg, "ARRIVAL_SLOTS", 3 * 4 - 1)  # 3 requests x 4 heads: one counter short
    whole, whole_pool, _ = _run(t, "triton", device, value_blocks=4)
    torch.testing.assert_close(whole, split, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole_pool, split_pool, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["triton", "triton/pdl"])
def test_split_heads_over_many_launches_equal_whole_heads(impl):
    """The compiled kernel's cross-program norm, launch after launch (each launch's counters must be
    back at zero for the next): verify windows and single rows of a Qwen3-Next-sized head split over
    4 programs against a program per head, float32, fresh inputs and NaN-poisoned outputs each time."""
    for seed in range(20):
        t = _case(1000 + seed, [4, 1, 4, 3], [False, True, False, False], hk=4, hv=8, dk=128, dv=128)
        ckpt = torch.full((4, 3, *t["pool"].shape[1:]), float("nan"))
        whole, whole_pool, whole_ckpt = _run(t, impl, "cuda", checkpoints=ckpt)
        split, split_pool, split_ckpt = _run(t, impl, "cuda", checkpoints=ckpt, value_blocks=4)
        assert not torch.isnan(split).any(), f"seed {seed}"
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
        torch.testing.assert_close(split_pool, whole_pool, rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
        torch.testing.assert_close(split_ckpt, whole_ckpt, rtol=1e-6, atol=1e-6, equal_nan=True, msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("value_blocks", [1, 4])
def test_bf16_fused_kernel_rounds_where_the_eager_layer_does(value_blocks):
    """bfloat16 on the GPU: the fused kernel against the layer's eager form (torch's gates, the Triton
    delta rule, torch's gated norm), which rounds ``beta``, the rule's output and the normed row to
    bf16. The two differ only in the order of the norm's sum, so nearly every element is equal and
    none is more than two bf16 steps away. (The interpreter on the CPU truncates bf16 casts, so this
    check needs the GPU.)"""
    t = _case(17, [1, 1, 1, 1], [False, True, False, False], hk=4, hv=8, dk=128, dv=128)
    for name in ("q", "k", "v", "a", "b", "z", "dt_bias", "norm_weight"):
        t[name] = t[name].to(torch.bfloat16)
    fused, fused_pool, _ = _run(t, "triton", "cuda", value_blocks=value_blocks)
    g, beta = gates(*[x.cuda() for x in (t["a"], t["b"], t["a_log"], t["dt_bias"])])
    core = torch.full_like(t["v"], float("nan")).cuda()
    pool = t["pool"].clone().cuda()
    args = _on("cuda", t["q"], t["k"], t["v"], g, beta, pool, t["slots"], t["cu"], t["has_state"], core)
    torch.ops.tscompile.gated_delta_rule(*args, "triton", True, 0, None)
    eager = gated_rms_norm(core, t["z"].cuda(), t["norm_weight"].cuda(), 1e-6).cpu()
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), eager.float(), rtol=2 ** -7, atol=1e-3)
    assert (fused == eager).float().mean() >= 0.9
    torch.testing.assert_close(fused_pool, pool.cpu(), rtol=1e-5, atol=1e-5)
