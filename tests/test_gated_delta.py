"""The recurrent-state ops (``tscompile::gated_delta_rule``, ``tscompile::causal_conv1d``) against
transformers' own reference functions of Qwen3-Next, in float32, on random data.

The torch implementation's two forms (recurrent, chunked) are checked against transformers'
recurrent and chunked functions for lengths that are not multiples of the chunk; the ops (torch
and Triton, the latter under the interpreter on the CPU) are checked over packed batches of
requests that start fresh or continue a slot, with NaN-poisoned outputs and the untouched slots
compared bit for bit.
"""

import pytest
import torch

from tscompile.custom_ops import gated_delta
from tscompile.custom_ops.gated_delta import chunked_reference, recurrent_reference

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

# "triton/pdl": the Triton kernels launched with PDL (on a Hopper GPU; elsewhere as "triton")
IMPLS = ["torch", "triton", "triton/pdl"]
# (impl, chunk) of the gated delta op: the torch form chunks at any size; Triton walks the tokens at 0
# and runs the chunked kernel at 16
GATED_DELTA_FORMS = [("torch", 8), ("triton", 0), ("triton", 16), ("triton/pdl", 0), ("triton/pdl", 16)]
FORM_IDS = ["torch", "triton-walk", "triton-chunked", "triton-pdl-walk", "triton-pdl-chunked"]
# transformers renamed its conv helpers across 5.x releases
_conv_update = getattr(qwen3_next, "causal_conv1d_update", None) or getattr(qwen3_next, "torch_causal_conv1d_update")


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def _inputs(gen, length, hk, hv, dk, dv):
    q = torch.randn(length, hk, dk, generator=gen)
    k = torch.randn(length, hk, dk, generator=gen)
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen) * 2  # log-decay <= 0
    beta = torch.rand(length, hv, generator=gen)
    return q, k, v, g, beta


def _hf(fn, q, k, v, g, beta, state, **kwargs):
    """transformers' reference over one request (batch of one, its [B, T, H, D] layout). Query/key
    heads are repeated to the value heads first: not every transformers 5.x release does it inside."""
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    out, final = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    return out[0], final[0]


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (16, 8), (37, 16), (64, 64)])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_chunked_and_recurrent_forms_equal_transformers(length, chunk, hk, hv):
    gen = torch.Generator().manual_seed(length * 100 + chunk + hv)
    dk, dv = 16, 8
    q, k, v, g, beta = _inputs(gen, length, hk, hv, dk, dv)
    state = torch.randn(hv, dk, dv, generator=gen)
    want_out, want_state = _hf(qwen3_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    want_chunk_out, want_chunk_state = _hf(qwen3_next.torch_chunk_gated_delta_rule, q, k, v, g, beta, state,
                                           chunk_size=chunk)
    torch.testing.assert_close(want_chunk_out, want_out, rtol=1e-4, atol=1e-4)  # the two oracles agree
    qp, kp = gated_delta._prepare_qk(q, k, hv, qk_l2norm=True)
    for out, final in (recurrent_reference(qp, kp, v, g, beta, state.clone()),
                       chunked_reference(qp, kp, v, g, beta, state.clone(), chunk)):
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, want_state, rtol=1e-4, atol=1e-4)


def _packed_case(seed, lengths, fresh, hk=2, hv=4, dk=16, dv=16, num_slots=8):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v, g, beta = _inputs(gen, total, hk, hv, dk, dv)
    pool = torch.randn(num_slots, hv, dk, dv, generator=gen)
    slots = torch.randperm(num_slots - 1, generator=gen)[:len(lengths)] + 1  # slot 0 is the null slot
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    has_state = torch.tensor([not f for f in fresh])
    return q, k, v, g, beta, pool, slots, cu, has_state


@pytest.mark.parametrize("impl,chunk", GATED_DELTA_FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("lengths,fresh", [([1, 1, 1], [False, False, False]),  # a decode step
                                           ([5, 1, 12], [True, False, False]),  # mixed: a fresh prompt, decode, chunk
                                           ([3, 20], [True, True]),
                                           ([45, 2, 33], [False, True, True])])  # several chunks, none whole
def test_gated_delta_op_continues_each_slot_like_transformers(impl, chunk, lengths, fresh, device):
    seed = sum(lengths) * 7 + len(impl) + chunk
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(seed, lengths, fresh)
    before = pool.clone()
    out = torch.full_like(v, float("nan"))
    args = _on(device, q, k, v, g, beta, pool, slots, cu, has_state, out)
    torch.ops.tscompile.gated_delta_rule(*args, impl, True, chunk, None)
    pool, out = args[5].cpu(), args[9].cpu()
    bounds = cu.tolist()
    for r, slot in enumerate(slots.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        start = None if fresh[r] else before[slot]
        want_out, want_state = _hf(qwen3_next.torch_recurrent_gated_delta_rule, q[lo:hi], k[lo:hi], v[lo:hi],
                                   g[lo:hi], beta[lo:hi], start)
        torch.testing.assert_close(out[lo:hi], want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], want_state, rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("impl,chunk", GATED_DELTA_FORMS, ids=FORM_IDS)
def test_padded_requests_of_a_graph_bucket_touch_only_the_null_slot(impl, chunk, device):
    """A whole-step prefill graph pads its requests to a bucket (null slot 0, an empty row range, a
    fresh state) and its tokens to a bucket (rows past the last request's): both ops give the live
    requests what an unpadded call gives, write no output row past them, and change no slot but
    the live ones and the null slot."""
    lengths, fresh = [5, 1, 12], [True, False, False]
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(41 + chunk + len(impl), lengths, fresh)
    pad_rows, pad_requests = 6, 2
    q, k, v, g, beta = (torch.cat([t, torch.randn(pad_rows, *t.shape[1:])]) for t in (q, k, v, g, beta))
    g = -g.abs()  # log-decays stay <= 0 on the padded rows too
    conv_x = torch.randn(q.shape[0], 24)
    conv_pool = torch.randn(pool.shape[0], 24, 3)
    weight = torch.randn(24, 4)

    def run(slots, cu, has_state, rows):
        ssm, conv = pool.clone(), conv_pool.clone()
        out, conv_out = torch.full_like(v[:rows], float("nan")), torch.full_like(conv_x[:rows], float("nan"))
        args = _on(device, q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows], ssm, slots, cu, has_state, out)
        torch.ops.tscompile.gated_delta_rule(*args, impl, True, chunk, None)
        conv_args = _on(device, conv_x[:rows], weight, None, conv, slots, cu, has_state, conv_out)
        torch.ops.tscompile.causal_conv1d(*conv_args, impl, "silu", None)
        return args[5].cpu(), args[9].cpu(), conv_args[3].cpu(), conv_args[7].cpu()

    live = sum(lengths)
    want = run(slots, cu, has_state, live)
    padded = run(torch.cat([slots, torch.zeros(pad_requests, dtype=slots.dtype)]),
                 torch.cat([cu, cu[-1:].repeat(pad_requests)]), torch.cat([has_state, torch.zeros(pad_requests,
                                                                                            dtype=torch.bool)]),
                 live + pad_rows)
    for w, p in ((want[0], padded[0]), (want[2], padded[2])):  # every slot but the null one as unpadded
        assert torch.equal(w[1:], p[1:])
    for w, p in ((want[1], padded[1]), (want[3], padded[3])):  # live rows as unpadded, padded rows unwritten
        assert torch.equal(w, p[:live]) and torch.isnan(p[live:]).all()


@pytest.mark.parametrize("chunk", [0, 16], ids=["triton-walk", "triton-chunk16"])
def test_gated_delta_state_split_across_calls_equals_one_call(chunk, device):
    """A prompt prefilled in two chunks and then decoded continues exactly as one long sequence."""
    q, k, v, g, beta, pool, slots, cu = _on(device, *_packed_case(11, [30], [True])[:8])
    whole_out = torch.empty_like(v)
    pool_whole = pool.clone()
    torch.ops.tscompile.gated_delta_rule(q, k, v, g, beta, pool_whole, slots, cu, torch.tensor([False], device=device),
                                         whole_out, "torch", True, 8, None)
    parts_out = torch.full_like(v, float("nan"))
    for lo, hi, keep in ((0, 13, False), (13, 29, True), (29, 30, True)):
        torch.ops.tscompile.gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, slots,
                                             torch.tensor([0, hi - lo], dtype=torch.int32, device=device),
                                             torch.tensor([keep], device=device), parts_out[lo:hi], "triton", True,
                                             chunk, None)
    torch.testing.assert_close(parts_out, whole_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[slots], pool_whole[slots], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [0, 16], ids=["triton-walk", "triton-chunked"])
def test_the_triton_gated_delta_reads_column_views_of_one_projection(chunk, device):
    """q, v and beta as the model hands them: column slices of one packed projection output (three
    more columns past them), and k from another buffer with its own row stride; the kernel reads
    each with its own strides in place and gives the bits it gives on contiguous copies."""
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(5 + chunk, [9, 1, 21], [True, False, False])
    t, (hk, dk), (hv, dv) = q.shape[0], q.shape[1:], v.shape[1:]
    packed = torch.cat([q.flatten(1), v.flatten(1), beta, torch.randn(t, 3)], dim=1).to(device)
    pq, pv, pbeta, _ = packed.split([hk * dk, hv * dv, hv, 3], dim=1)
    pk = torch.cat([torch.randn(t, 5), k.flatten(1)], dim=1).to(device)[:, 5:]
    views = (pq.view(t, hk, dk), pk.view(t, hk, dk), pv.view(t, hv, dv), pbeta)
    assert views[0].stride() != views[1].stride()
    assert not any(x.is_contiguous() for x in views)
    results = []
    for qkvb in (_on(device, q, k, v, beta), views):
        args = [*qkvb[:3], g.to(device), qkvb[3], *_on(device, pool.clone(), slots, cu, has_state),
                torch.full_like(v, float("nan"), device=device)]
        torch.ops.tscompile.gated_delta_rule(*args, "triton", True, chunk, None)
        results.append((args[9].cpu(), args[5].cpu()))
    (out, state), (view_out, view_state) = results
    assert not out.isnan().any()
    assert torch.equal(view_out, out) and torch.equal(view_state, state)


@pytest.mark.parametrize("dk,dv", [(8, 24), (32, 8)])
def test_the_chunked_kernel_pads_head_sizes_below_its_tile_and_odd_ones(dk, dv, device):
    """Head sizes the chunked kernel pads to its 16-wide tiles (and a value size that is no power of
    two) give the walk's outputs and states."""
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(dk + dv, [19, 40], [True, False], dk=dk, dv=dv)
    results = []
    for chunk in (0, 16):
        args = _on(device, q, k, v, g, beta, pool.clone(), slots, cu, has_state, torch.full_like(v, float("nan")))
        torch.ops.tscompile.gated_delta_rule(*args, "triton", True, chunk, None)
        results.append((args[9].cpu(), args[5].cpu()))
    (walk_out, walk_pool), (chunk_out, chunk_pool) = results
    torch.testing.assert_close(chunk_out, walk_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk_pool, walk_pool, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spread", [0.0, 0.05])
def test_the_chunked_kernel_holds_where_its_system_is_far_from_identity(spread, device):
    """Keys that all point one way, barely decaying, written at (nearly) full strength: the chunk's
    triangular system (I + A) has entries near 1, so every factor of its inverse counts (random data
    hides a missing high power of A) and the powers' entries are largest."""
    gen = torch.Generator().manual_seed(int(spread * 100))
    length, hk, hv, dk, dv = 37, 1, 2, 16, 16
    direction = torch.randn(dk, generator=gen)
    q = torch.randn(length, hk, dk, generator=gen)
    k = direction + spread * torch.randn(length, hk, dk, generator=gen)
    v = torch.randn(length, hv, dv, generator=gen)
    g = -0.001 * spread * torch.rand(length, hv, generator=gen)
    beta = 1 - 2 * spread * torch.rand(length, hv, generator=gen)
    pool = torch.randn(3, hv, dk, dv, generator=gen)
    slots, cu, has_state = torch.tensor([1]), torch.tensor([0, length], dtype=torch.int32), torch.tensor([True])
    want_out, want_state = _hf(qwen3_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, pool[1])
    args = _on(device, q, k, v, g, beta, pool.clone(), slots, cu, has_state, torch.full_like(v, float("nan")))
    torch.ops.tscompile.gated_delta_rule(*args, "triton", True, 16, None)
    torch.testing.assert_close(args[9].cpu(), want_out, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(args[5].cpu()[1], want_state, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("chunk", [8, 32])
def test_the_chunked_kernel_refuses_other_chunks(chunk):
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(3, [20], [True])
    with pytest.raises(ValueError, match=rf"^tscompile: the chunked gated delta kernel takes chunks of 16 rows, got "
                                         rf"{chunk}; pass 16, or 0 to walk the tokens"):
        torch.ops.tscompile.gated_delta_rule(q, k, v, g, beta, pool, slots, cu, has_state, torch.empty_like(v),
                                             "triton", True, chunk, None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_op_equals_transformers(impl, bias, device):
    gen = torch.Generator().manual_seed(5 + bias)
    channels, width, num_slots = 24, 4, 6
    lengths, fresh = [1, 2, 9, 1], [False, True, False, True]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    pool = torch.randn(num_slots, channels, width - 1, generator=gen)
    slots = torch.tensor([3, 1, 5, 2])
    cu = torch.tensor([0] + lengths).cumsum(0)
    before = pool.clone()
    out = torch.full_like(x, float("nan"))
    args = _on(device, x, weight, b, pool, slots, cu, torch.tensor([not f for f in fresh]), out)
    torch.ops.tscompile.causal_conv1d(*args, impl, "silu", None)
    pool, out = args[3].cpu(), args[7].cpu()
    bounds = cu.tolist()
    for r, slot in enumerate(slots.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        # transformers keeps a window of `width` inputs; its oldest entry never reaches an output
        window = torch.zeros(1, channels, width) if fresh[r] else torch.cat(
            [torch.zeros(1, channels, 1), before[slot][None]], dim=-1)
        want = _conv_update(x[lo:hi].t()[None].clone(), window, weight, b, activation="silu")
        torch.testing.assert_close(out[lo:hi], want[0].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], window[0, :, 1:], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[[0, 4]], before[[0, 4]])


def test_causal_conv1d_over_chunks_equals_whole_sequence(device):
    gen = torch.Generator().manual_seed(3)
    channels, width = 8, 4
    x = torch.randn(11, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    # the whole sequence in one causal convolution (left zero padding), then SiLU
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], weight[:, None, :], padding=width - 1,
                                                               groups=channels)[0, :, :x.shape[0]].t())
    pool = torch.randn(2, channels, width - 1, generator=gen)
    xd, weight, pool = _on(device, x, weight, pool)
    out = torch.full_like(xd, float("nan"))
    slot = torch.tensor([1], device=device)
    for lo, hi, keep in ((0, 2, False), (2, 3, True), (3, 11, True)):
        torch.ops.tscompile.causal_conv1d(xd[lo:hi], weight, None, pool, slot, torch.tensor([0, hi - lo], device=device),
                                          torch.tensor([keep], device=device), out[lo:hi], "triton", "silu", None)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)


def _poisoned(*shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_delta_checkpoints_hold_the_state_after_each_row_but_the_last(impl, device):
    """Verify windows (rows 4, 2 and 3, the buffer 3 rows deep and one request deeper than the step):
    entry [r, i] is transformers' state after the request's first i + 1 rows; entries past a
    request's rows - 1, and the spare request, stay as they were (NaN); the slot still gets the last."""
    lengths, width = [4, 2, 3], 3
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(17 + len(impl), lengths, [False, True, False])
    before = pool.clone()
    checkpoints = _poisoned(len(lengths) + 1, width, *pool.shape[1:])
    args = _on(device, q, k, v, g, beta, pool, slots, cu, has_state, _poisoned(*v.shape), checkpoints)
    torch.ops.tscompile.gated_delta_rule(*args[:10], impl, True, 0 if impl == "triton" else 8, args[10])
    pool, out, checkpoints = args[5].cpu(), args[9].cpu(), args[10].cpu()
    bounds = cu.tolist()
    for r, slot in enumerate(slots.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        start = None if not has_state[r] else before[slot]
        for i in range(hi - lo):
            want_out, want_state = _hf(qwen3_next.torch_recurrent_gated_delta_rule, q[lo:lo + i + 1], k[lo:lo + i + 1],
                                       v[lo:lo + i + 1], g[lo:lo + i + 1], beta[lo:lo + i + 1], start)
            torch.testing.assert_close(out[lo + i], want_out[i], rtol=1e-4, atol=1e-4)
            if i < hi - lo - 1:
                torch.testing.assert_close(checkpoints[r, i], want_state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], want_state, rtol=1e-4, atol=1e-4)
        assert torch.isnan(checkpoints[r, hi - lo - 1:]).all()
    assert torch.isnan(checkpoints[len(lengths)]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_conv1d_checkpoints_hold_the_window_after_each_row_but_the_last(impl, device):
    gen = torch.Generator().manual_seed(23 + len(impl))
    channels, width, depth = 24, 4, 4
    lengths, fresh = [5, 1, 3], [False, True, False]
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    pool = torch.randn(6, channels, width - 1, generator=gen)
    slots, cu = torch.tensor([4, 1, 3]), torch.tensor([0] + lengths).cumsum(0)
    before = pool.clone()
    checkpoints = _poisoned(len(lengths), depth, channels, width - 1)
    args = _on(device, x, weight, None, pool, slots, cu, torch.tensor([not f for f in fresh]), _poisoned(*x.shape),
               checkpoints)
    torch.ops.tscompile.causal_conv1d(*args[:8], impl, "silu", args[8])
    pool, checkpoints = args[3].cpu(), args[8].cpu()
    bounds = cu.tolist()
    for r, slot in enumerate(slots.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        old = torch.zeros(channels, width - 1) if fresh[r] else before[slot]
        inputs = torch.cat([old, x[lo:hi].t()], dim=1)  # the old window, then the rows, oldest first
        for i in range(hi - lo - 1):
            assert torch.equal(checkpoints[r, i], inputs[:, i + 1: i + width]), (r, i)
        assert torch.equal(pool[slot], inputs[:, -(width - 1):])
        assert torch.isnan(checkpoints[r, hi - lo - 1:]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drafts", [3, 2], ids=["window-as-deep-as-the-buffer", "narrower-window"])
def test_commit_copies_each_requests_checkpoint_at_its_accepted_length_in_every_layer(impl, drafts, device):
    """Request r's slot, in every layer, becomes checkpoint [r, accepted[r]]; a request that accepted
    all ``drafts`` drafts of its window, and every other slot, keep their bits (also where the buffer
    is deeper than the window). A slot's state spans several of the kernel's copy blocks."""
    gen = torch.Generator().manual_seed(29 + len(impl) + drafts)
    layers, num_slots, reqs, depth = 3, 7, 4, 3
    conv = torch.randn(layers, num_slots, 300, 3, generator=gen)
    ssm = torch.randn(layers, num_slots, 4, 32, 40, generator=gen)  # 5120 elements: two copy blocks
    conv_ck = torch.randn(layers, reqs + 1, depth, 300, 3, generator=gen)
    ssm_ck = torch.randn(layers, reqs + 1, depth, 4, 32, 40, generator=gen)
    slots, accepted = torch.tensor([5, 2, 6, 1]), torch.tensor([1, drafts, 0, drafts - 1], dtype=torch.int32)
    want_conv, want_ssm, before = conv.clone(), ssm.clone(), ssm.clone()
    for r, (slot, a) in enumerate(zip(slots.tolist(), accepted.tolist())):
        if a < drafts:
            want_conv[:, slot], want_ssm[:, slot] = conv_ck[:, r, a], ssm_ck[:, r, a]
    args = _on(device, conv, ssm, conv_ck, ssm_ck, slots, accepted)
    torch.ops.tscompile.commit_state_checkpoints(*args, drafts, impl)
    assert torch.equal(args[0].cpu(), want_conv) and torch.equal(args[1].cpu(), want_ssm)
    assert torch.equal(want_ssm[:, 2], before[:, 2]) and not torch.equal(want_ssm[:, 5], before[:, 5])
    with pytest.raises(ValueError, match=r"^tscompile: commit_state_checkpoints of 4 requests x 4 drafts does not "
                                         r"fit checkpoints of 5 requests x 3 rows"):
        torch.ops.tscompile.commit_state_checkpoints(*args, 4, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dk,dv,channels", [(16, 16, 12), (32, 128, 300)], ids=["one-block", "several-blocks"])
def test_a_committed_verify_window_equals_running_only_the_kept_rows(impl, dk, dv, channels, device):
    """The state ops over whole windows of 4 rows with checkpoints, then the commit, leave every slot
    as the same ops over only each request's kept rows (accepted + 1) would; also where a head's
    values span two of the walk's blocks, the channels two of the convolution's and a slot's state
    several of the commit's copy blocks."""
    hk, hv, width, rows = 2, 4, 4, 4
    accepted = torch.tensor([0, 3, 1, 2], dtype=torch.int32)
    reqs = accepted.shape[0]
    gen = torch.Generator().manual_seed(31 + len(impl) + dv)
    q, k, v, g, beta = _inputs(gen, reqs * rows, hk, hv, dk, dv)
    x, weight = torch.randn(reqs * rows, channels, generator=gen), torch.randn(channels, width, generator=gen)
    ssm = torch.randn(1, 6, hv, dk, dv, generator=gen)
    conv = torch.randn(1, 6, channels, width - 1, generator=gen)
    slots, keep = torch.tensor([3, 5, 1, 4]), torch.ones(reqs, dtype=torch.bool)
    chunk = 8 if impl == "torch" else 0
    weight_d, slots_d, accepted_d = _on(device, weight, slots, accepted)

    def run_ops(pick, cu, ssm_pool, conv_pool, ssm_ck=None, conv_ck=None):
        qd, kd, vd, gd, bd, xd = _on(device, *(t[pick] for t in (q, k, v, g, beta, x)))
        meta = _on(device, slots, cu, keep)
        torch.ops.tscompile.gated_delta_rule(qd, kd, vd, gd, bd, ssm_pool, *meta, torch.empty_like(vd), impl, True,
                                             chunk, ssm_ck)
        torch.ops.tscompile.causal_conv1d(xd, weight_d, None, conv_pool, *meta, torch.empty_like(xd), impl, "silu",
                                          conv_ck)

    got_ssm, got_conv, ck_ssm, ck_conv = _on(device, ssm.clone(), conv.clone(),
                                             _poisoned(1, reqs, rows - 1, hv, dk, dv),
                                             _poisoned(1, reqs, rows - 1, channels, width - 1))
    run_ops(torch.arange(reqs * rows), torch.arange(0, reqs * rows + 1, rows), got_ssm[0], got_conv[0], ck_ssm[0],
            ck_conv[0])
    torch.ops.tscompile.commit_state_checkpoints(got_conv, got_ssm, ck_conv, ck_ssm, slots_d, accepted_d, rows - 1,
                                                 impl)

    want_ssm, want_conv = _on(device, ssm.clone(), conv.clone())
    kept = (accepted + 1).tolist()
    run_ops(torch.cat([torch.arange(r * rows, r * rows + n) for r, n in enumerate(kept)]),
            torch.tensor([0] + kept).cumsum(0), want_ssm[0], want_conv[0])
    torch.testing.assert_close(got_ssm.cpu(), want_ssm.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_conv.cpu(), want_conv.cpu())
    assert not torch.equal(got_ssm.cpu(), ssm)  # the step moved the states


def test_opcheck_state_ops():
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(2, [3, 1], [True, False])
    torch.library.opcheck(torch.ops.tscompile.gated_delta_rule.default,
                          (q, k, v, g, beta, pool, slots, cu, has_state, torch.empty_like(v), "torch", True, 4, None))
    x = torch.randn(4, 8)
    torch.library.opcheck(torch.ops.tscompile.causal_conv1d.default,
                          (x, torch.randn(8, 4), None, torch.randn(3, 8, 3), torch.tensor([1, 2]),
                           torch.tensor([0, 3, 4]), torch.tensor([True, False]), torch.empty_like(x), "torch", "silu",
                           None))
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    torch.library.opcheck(torch.ops.tscompile.gated_delta_rule.default,
                          (q[:4], k[:4], v[:4], g[:4], beta[:4], pool, slots, cu, has_state, torch.empty_like(v[:4]),
                           "torch", True, 4, torch.zeros(2, 1, *pool.shape[1:])))
    torch.library.opcheck(torch.ops.tscompile.causal_conv1d.default,
                          (x, torch.randn(8, 4), None, torch.randn(3, 8, 3), torch.tensor([1, 2]), cu,
                           torch.tensor([True, False]), torch.empty_like(x), "torch", "silu", torch.zeros(2, 1, 8, 3)))
    torch.library.opcheck(torch.ops.tscompile.commit_state_checkpoints.default,
                          (torch.randn(2, 3, 8, 3), torch.randn(2, 3, 4, 2, 2), torch.randn(2, 2, 1, 8, 3),
                           torch.randn(2, 2, 1, 4, 2, 2), torch.tensor([1, 2]), torch.tensor([0, 1]), 1, "torch"))


def test_checkpoints_of_the_wrong_shape_are_refused():
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(3, [2, 2], [True, True])
    for checkpoints in (torch.zeros(1, 1, *pool.shape[1:]), torch.zeros(2, 1, 4, 16, 8),
                        torch.zeros(2, 1, *pool.shape[1:], dtype=torch.float64), torch.zeros(2, 0, *pool.shape[1:])):
        with pytest.raises(ValueError, match=r"^tscompile: gated_delta_rule checkpoints .* do not fit 2 requests"):
            torch.ops.tscompile.gated_delta_rule(q, k, v, g, beta, pool, slots, cu, has_state, torch.empty_like(v),
                                                 "torch", True, 4, checkpoints)


def test_the_ops_run_where_torch_bumps_versions_of_the_arguments_as_called(monkeypatch):
    """torch 2.11's custom-op wrapper bumps the version of each mutated argument at its position in
    the call as made, defaults not filled in (later releases fill them first): a mutated optional
    argument left out of a call was an IndexError on the GPU machine. Every call, eager and from an
    Inductor graph, passes ``checkpoints``, so the ops run under that rule too."""
    import torch._library.utils as library_utils

    if hasattr(library_utils, "fill_defaults"):
        monkeypatch.setattr(library_utils, "fill_defaults", lambda schema, args, kwargs: (args, kwargs))
    q, k, v, g, beta, pool, slots, cu, has_state = _packed_case(5, [2, 3], [True, False])

    def layer(q, k, v, g, beta, pool, x, conv_pool):
        out, conv_out = torch.empty_like(v), torch.empty_like(x)
        torch.ops.tscompile.causal_conv1d(x, torch.ones(x.shape[1], 4), None, conv_pool, slots, cu, has_state,
                                          conv_out, "torch", "silu", None)
        torch.ops.tscompile.gated_delta_rule(q, k, v, g, beta, pool, slots, cu, has_state, out, "torch", True, 4, None)
        return out + 1, conv_out

    x, conv_pool = torch.randn(5, 6), torch.randn(pool.shape[0], 6, 3)
    want = layer(q, k, v, g, beta, pool.clone(), x, conv_pool.clone())
    got = torch.compile(layer, backend="inductor", fullgraph=True)(q, k, v, g, beta, pool.clone(), x, conv_pool.clone())
    torch.testing.assert_close(got, want)


def test_unknown_impl_and_activation_are_refused():
    x = torch.randn(2, 8)
    args = (x, torch.randn(8, 4), None, torch.randn(2, 8, 3), torch.tensor([1]), torch.tensor([0, 2]),
            torch.tensor([False]), torch.empty_like(x))
    with pytest.raises(ValueError, match="tscompile: state kernel impl 'cuda'"):
        torch.ops.tscompile.causal_conv1d(*args, "cuda", "silu", None)
    with pytest.raises(ValueError, match="tscompile: causal_conv1d activation 'gelu'"):
        torch.ops.tscompile.causal_conv1d(*args, "torch", "gelu", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["conv", "delta"])
def test_triton_decode_steps_on_small_heads_update_each_slot_once(op):
    """Decode-shaped calls (one row per request, every request continuing its slot) at head and
    channel sizes smaller than a block's threads, so each element lives in several warps: a slot
    read after another warp already wrote it back shows up as a drift from the torch oracle. Many
    fresh draws, because a lost ordering shows only under some warp schedules."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(150):
        reqs = 1 + trial % 4
        slots, cu = torch.arange(1, reqs + 1), torch.arange(reqs + 1, dtype=torch.int32)
        keep = torch.ones(reqs, dtype=torch.bool)
        if op == "conv":
            x, weight = torch.randn(reqs, 64, generator=gen), torch.randn(64, 4, generator=gen)
            pool = torch.randn(reqs + 1, 64, 3, generator=gen)
            tail = (slots, cu, keep)
            run = lambda impl, p, o, dev: torch.ops.tscompile.causal_conv1d(  # noqa: E731
                *_on(dev, x, weight), None, p, *_on(dev, *tail), o, impl, "silu", None)
            out_like = x
        else:
            q, k, v, g, beta = _inputs(gen, reqs, 2, 4, 8, 8)
            pool = torch.randn(reqs + 1, 4, 8, 8, generator=gen)
            run = lambda impl, p, o, dev: torch.ops.tscompile.gated_delta_rule(  # noqa: E731
                *_on(dev, q, k, v, g, beta), p, *_on(dev, slots, cu, keep), o, impl, True, 8, None)
            out_like = v
        want_pool, want_out = pool.clone(), torch.full_like(out_like, float("nan"))
        run("torch", want_pool, want_out, "cpu")
        got_pool, got_out = pool.cuda(), torch.full_like(out_like, float("nan")).cuda()
        run("triton", got_pool, got_out, "cuda")
        torch.testing.assert_close(got_out.cpu(), want_out, rtol=1e-4, atol=1e-4, msg=f"trial {trial}")
        torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=1e-4, atol=1e-4, msg=f"trial {trial}")
