"""The state backend's storage (``tscompile.kv_cache.state_pool``): slot allocation with the null
slot reserved, pointer-stable slot metadata per batch size with padding on the null slot, and state
continuity through ``tscompile::gated_delta_rule`` / ``tscompile::causal_conv1d`` when requests are
split into chunks, interleaved with others, and preempted (slot freed, re-prefilled elsewhere)."""

import pytest
import torch

from tscompile.custom_ops import gated_delta  # noqa: F401  (registers the ops)
from tscompile.kv_cache.state_pool import NULL_SLOT, StatePool, StateSlotAllocator, StateSlotMetadata, StateSpec

SPEC = StateSpec(layer_ids=(0, 2), conv_channels=6, conv_width=4, num_v_heads=2, key_head_dim=3, value_head_dim=5)


def test_allocator_reserves_null_slot_and_reuses_freed():
    alloc = StateSlotAllocator(4)
    got = [alloc.allocate(r) for r in "abc"]
    assert got == [1, 2, 3] and NULL_SLOT not in got
    with pytest.raises(ValueError, match="^tscompile: no free state slot"):
        alloc.allocate("d")
    with pytest.raises(ValueError, match="^tscompile: request 'a' already holds"):
        alloc.allocate("a")
    alloc.free("b")
    assert alloc.num_free == 1 and alloc.allocate("d") == 2 and alloc.slot_of("d") == 2
    with pytest.raises(ValueError, match="^tscompile: a state pool needs at least 2 slots"):
        StateSlotAllocator(1)


def test_pool_shapes_bytes_and_poison():
    pool = StatePool.allocate(SPEC, 5, "cpu")
    conv, ssm = pool.layer_state(2)
    assert conv.shape == (5, 6, 3) and ssm.shape == (5, 2, 3, 5)
    assert conv.dtype == ssm.dtype == torch.float32
    assert pool.nbytes == 5 * SPEC.slot_bytes == 5 * 4 * 2 * (6 * 3 + 2 * 3 * 5)
    assert SPEC.decode_step_bytes(8) == 2 * 8 * SPEC.slot_bytes
    pool.fill_(float("nan"))
    assert torch.isnan(pool.ssm[0]).all() and torch.isnan(pool.conv[2]).all()


def test_checkpoints_are_allocated_beside_the_stacked_layers_and_poisoned_with_them():
    pool = StatePool.allocate(SPEC, 5, "cpu", checkpoint_requests=4, checkpoint_rows=3)
    assert pool.conv_all.shape == (2, 5, 6, 3) and pool.ssm_all.shape == (2, 5, 2, 3, 5)
    assert pool.conv_checkpoints.shape == (2, 4, 3, 6, 3) and pool.ssm_checkpoints.shape == (2, 4, 3, 2, 3, 5)
    assert pool.checkpoint_rows == 3
    # a layer's slots and checkpoints are views of the stacked tensors the commit launch reads
    assert pool.ssm[2].data_ptr() == pool.ssm_all[1].data_ptr()
    conv_ck, ssm_ck = pool.layer_checkpoints(2)
    assert ssm_ck.data_ptr() == pool.ssm_checkpoints[1].data_ptr() and conv_ck.shape == (4, 3, 6, 3)
    assert pool.nbytes == 5 * SPEC.slot_bytes + 4 * 3 * SPEC.slot_bytes
    pool.fill_(float("nan"))
    assert torch.isnan(pool.ssm_checkpoints).all() and torch.isnan(pool.conv_checkpoints).all()
    plain = StatePool.allocate(SPEC, 5, "cpu")
    assert plain.checkpoint_rows == 0 and plain.layer_checkpoints(0) is None
    need = (5 + 4 * 3) * SPEC.slot_bytes
    assert StatePool.allocate(SPEC, 5, "cpu", checkpoint_requests=4, checkpoint_rows=3, free_bytes=need).nbytes == need
    with pytest.raises(ValueError, match=r"^tscompile: the recurrent state of 4 requests, with 3 verify checkpoints "
                                         r"each, takes .* GiB, more than the .* GiB free on the device; lower "
                                         r"max_num_seqs or num_speculative_tokens"):
        StatePool.allocate(SPEC, 5, "cpu", checkpoint_requests=4, checkpoint_rows=3, free_bytes=need - 1)


def test_verify_windows_need_checkpoints_for_every_request_and_row():
    from tscompile.attention.state_backend import StateBackend

    backend = StateBackend(StatePool.allocate(SPEC, 5, "cpu", checkpoint_requests=4, checkpoint_rows=3), "cpu")
    backend.allocate_decode_buffers(4, 4)
    assert backend.decode_views(2, 4).checkpoints and not backend.decode_views(2, 1).checkpoints
    for max_bs, width in ((4, 5), (8, 4)):
        with pytest.raises(ValueError, match=r"^tscompile: verify steps of .* need state checkpoints .* "
                                             r"checkpoint_requests="):
            backend.allocate_decode_buffers(max_bs, width)
    with pytest.raises(ValueError, match=r"^tscompile: verify steps of 4 requests x 2 rows .* has 0 x 0"):
        StateBackend(StatePool.allocate(SPEC, 5, "cpu"), "cpu").allocate_decode_buffers(4, 2)
    StateBackend(StatePool.allocate(SPEC, 5, "cpu"), "cpu").allocate_decode_buffers(4, 1)  # plain decode needs none


def test_metadata_pointer_stable_and_padding_on_null_slot():
    meta = StateSlotMetadata("cpu")
    slots4, flags4 = meta.refresh([3, 1], [True, False], 4)
    ptrs = (slots4.data_ptr(), flags4.data_ptr())
    assert slots4.tolist() == [3, 1, NULL_SLOT, NULL_SLOT] and flags4.tolist() == [True, False, False, False]
    again = meta.refresh([2, 5, 7], [False, True, True], 4)
    assert (again[0].data_ptr(), again[1].data_ptr()) == ptrs
    assert again[0].tolist() == [2, 5, 7, NULL_SLOT] and again[1].tolist() == [False, True, True, False]
    other = meta.refresh([2], [True], 8)
    assert other[0].data_ptr() != ptrs[0] and other[0].shape == (8,)
    with pytest.raises(ValueError, match="^tscompile: state metadata for 3 slots"):
        meta.refresh([1, 2, 3], [True, True, True], 2)


def _request(gen, length):
    hk, hv, dk, dv, c = 1, SPEC.num_v_heads, SPEC.key_head_dim, SPEC.value_head_dim, SPEC.conv_channels
    return dict(q=torch.randn(length, hk, dk, generator=gen), k=torch.randn(length, hk, dk, generator=gen),
                v=torch.randn(length, hv, dv, generator=gen), g=-torch.rand(length, hv, generator=gen) * 2,
                beta=torch.rand(length, hv, generator=gen), x=torch.randn(length, c, generator=gen))


def _step(pool, meta, layer, weight, pieces, bucket):
    """One packed step: ``pieces`` = [(slot, has_state, request, lo, hi)], padded to ``bucket``
    requests with empty rows on the null slot. Returns the per-piece (gdr out, conv out)."""
    conv_pool, ssm_pool = pool.layer_state(layer)
    slots, flags = meta.refresh([p[0] for p in pieces], [p[1] for p in pieces], bucket)
    lens = [p[4] - p[3] for p in pieces] + [0] * (bucket - len(pieces))
    cu = torch.tensor([0] + lens).cumsum(0)
    cat = {n: torch.cat([p[2][n][p[3]:p[4]] for p in pieces]) for n in ("q", "k", "v", "g", "beta", "x")}
    out = torch.full_like(cat["v"], float("nan"))
    conv_out = torch.full_like(cat["x"], float("nan"))
    torch.ops.tscompile.gated_delta_rule(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], ssm_pool, slots, cu,
                                         flags, out, "torch", True, 4, None)
    torch.ops.tscompile.causal_conv1d(cat["x"], weight, None, conv_pool, slots, cu, flags, conv_out, "torch", "silu",
                                      None)
    b = cu.tolist()
    return [(out[b[i]:b[i + 1]], conv_out[b[i]:b[i + 1]]) for i in range(len(pieces))]


def test_state_continues_across_chunks_and_survives_preemption():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(SPEC.conv_channels, SPEC.conv_width, generator=gen)
    reqs = {"a": _request(gen, 11), "b": _request(gen, 7)}
    # reference: each request's whole sequence in one call from a fresh slot
    want = {}
    for name, req in reqs.items():
        pool, meta = StatePool.allocate(SPEC, 3, "cpu"), StateSlotMetadata("cpu")
        want[name] = _step(pool, meta, 0, weight, [(1, False, req, 0, len(req["x"]))], 1)[0]

    pool, meta = StatePool.allocate(SPEC, 5, "cpu"), StateSlotMetadata("cpu")
    pool.fill_(float("nan"))  # a fresh request must never read its slot
    got = {n: ([], []) for n in reqs}

    def run(pieces, bucket):
        for (slot, _, req, _, _), (o, c) in zip(pieces, _step(pool, meta, 0, weight, pieces, bucket)):
            name = "a" if req is reqs["a"] else "b"
            got[name][0].append(o)
            got[name][1].append(c)

    sa = pool.slots.allocate("a")
    run([(sa, False, reqs["a"], 0, 5)], 2)  # a's first chunk
    sb = pool.slots.allocate("b")
    run([(sa, True, reqs["a"], 5, 9), (sb, False, reqs["b"], 0, 3)], 4)  # a continues, b starts
    # preempt b: its slot goes back and b re-prefills from the start in another slot
    pool.slots.free("b")
    got["b"] = ([], [])
    pool.slots.allocate("c")  # someone else takes b's old slot
    sb = pool.slots.allocate("b")
    run([(sb, False, reqs["b"], 0, 4), (sa, True, reqs["a"], 9, 10)], 2)
    run([(sa, True, reqs["a"], 10, 11), (sb, True, reqs["b"], 4, 5)], 4)  # decode steps, padded rows
    run([(sb, True, reqs["b"], 5, 6)], 4)
    run([(sb, True, reqs["b"], 6, 7)], 4)
    for name in reqs:
        out, conv = torch.cat(got[name][0]), torch.cat(got[name][1])
        torch.testing.assert_close(out, want[name][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv, want[name][1], rtol=1e-5, atol=1e-5)
    assert pool.slots.slot_of("c") == 2  # b's old slot was handed on; b re-prefilled in slot 3
    assert torch.isnan(pool.ssm[0][4]).all() and torch.isnan(pool.conv[0][4]).all()  # never held: untouched
    assert torch.isnan(pool.ssm[2]).all()  # another layer's state is separate
