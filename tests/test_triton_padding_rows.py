"""The Triton extend kernels' own work on a step padded to a token bucket, against the torch oracle.

A whole-step prefill pads its T token rows past the live ``n = qo_indptr[-1]`` (token 0 at position
0, writing the null slot 0) and its requests past the live ones (empty query ranges). The op must
give the padding rows zeros and write every row's K/V. The Triton extend kernels do both in the
launches they make anyway: the spare programs past the last query block zero the padding rows, and
the dense kernel also writes the new K/V rows itself (no ``_kv_write_kernel`` launch). These tests
poison the output (NaN) and, for the dense kernel, the write slots, and compare with the torch impl,
whose padding rows ``run_attention`` zeroes with ``masked_fill_``.

Small tiles so a few tokens span several query blocks and the spare programs are few: the worst
case for "enough spare programs to own every padding row" is every request one row past a whole
number of blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import random_paged_batch, run_attention
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops import triton_extend as te

SCALE = 0.25


@pytest.fixture
def small_tiles(monkeypatch):
    """8-position blocks for the paged kernel, 16-row tiles for the dense one (4 positions at GQA
    group 4), 16 keys per tile."""
    monkeypatch.setattr(ta, "EXTEND_CONFIGS", {d: (8, 16, 4, 1) for d in (16, 32, 64, 128, 256)})
    monkeypatch.setattr(te, "EXTEND_DENSE_CONFIGS", {d: (16, 16, 4, 1) for d in (16, 32, 64, 128, 256)})
    monkeypatch.setattr(te, "EXTEND_DENSE_SHAPE_CONFIGS", {})


def padded_step(q_lens, kv_lens, *, tail_rows, empty_requests, head_dim, group=4, dtype=torch.float32,
                seed=0, same_tail=True):
    """A ragged batch padded as a whole-step prefill bucket: ``tail_rows`` token rows past the live
    ones (write slot 0; identical rows when ``same_tail``, as token 0 at position 0 gives) and
    ``empty_requests`` request rows with an empty query range, KV length 0 and a null page row."""
    batch = random_paged_batch(q_lens, kv_lens, page_size=4, num_kv_heads=2, group=group, head_dim=head_dim,
                               dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in ("q", "k", "v"):
        t = batch[name]
        shape = (1 if same_tail else tail_rows, *t.shape[1:])
        extra = torch.randn(shape, generator=g).to(t.dtype).expand(tail_rows, *t.shape[1:])
        batch[name] = torch.cat([t, extra])
    batch["write_loc"] = torch.cat([batch["write_loc"], torch.zeros(tail_rows, dtype=torch.int64)])
    n = batch["qo_indptr"][-1:]
    batch["qo_indptr"] = torch.cat([batch["qo_indptr"], n.expand(empty_requests)])
    batch["seq_lens"] = torch.cat([batch["seq_lens"], torch.zeros(empty_requests, dtype=torch.int32)])
    pt = batch["page_table"]
    batch["page_table"] = torch.cat([pt, torch.zeros(empty_requests, pt.shape[1], dtype=pt.dtype)])
    return batch


# (q_lens, tail rows, empty requests): one short prompt in a large bucket; every request one row past
# whole blocks (the fewest spare programs); no padding at all; padding only in the requests
SHAPES = [
    ([5], 27, 1),
    ([9, 9, 5, 1], 40, 0),
    ([17, 9], 7, 2),
    ([8, 3], 0, 0),
    ([6, 2], 0, 2),
]


@pytest.mark.parametrize("head_dim", [64, 32], ids=["dense", "paged"])
@pytest.mark.parametrize("q_lens,tail_rows,empty", SHAPES)
def test_padding_rows_are_zero_and_the_cache_equals_torchs(head_dim, q_lens, tail_rows, empty, small_tiles):
    """Through the op: live rows as the oracle, padding rows exact zeros (the NaN poison overwritten),
    both caches bit for bit the oracle's. head_dim 64 runs the dense kernel, 32 the paged one."""
    kv_lens = [q + p for q, p in zip(q_lens, (0, 13, 4, 21))]
    batch = padded_step(q_lens, kv_lens, tail_rows=tail_rows, empty_requests=empty, head_dim=head_dim,
                        seed=len(q_lens) + tail_rows)
    out, k_cache, v_cache = run_attention(batch, "triton", decode=False, scale=SCALE)
    ref, ref_k, ref_v = run_attention(batch, "torch", decode=False, scale=SCALE)
    n = int(batch["qo_indptr"][-1])
    assert not out.isnan().any(), "a row was never written"
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "a padding row is not zero"
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_bfloat16_through_the_dense_kernel(small_tiles):
    batch = padded_step([9, 5], [9, 20], tail_rows=18, empty_requests=1, head_dim=64, dtype=torch.bfloat16, seed=4)
    out, k_cache, v_cache = run_attention(batch, "triton", decode=False, scale=SCALE)
    ref, ref_k, ref_v = run_attention(batch, "torch", decode=False, scale=SCALE)
    n = int(batch["qo_indptr"][-1])
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("same_tail", [True, False])
def test_dense_kernel_writes_every_row_without_reading_it_back(same_tail, small_tiles):
    """``dense_extend(write_loc=...)`` alone, with every write slot poisoned first: the new rows land
    in their slots (a padding row's at the null slot: one of the writers' rows), nothing else moves,
    and the output cannot have read a poisoned slot."""
    batch = padded_step([7, 10], [20, 10], tail_rows=9, empty_requests=1, head_dim=64, seed=8, same_tail=same_tail)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    loc = batch["write_loc"]
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[loc] = float("nan")
    before = [c.clone() for c in (k_cache, v_cache)]
    out = torch.full_like(batch["q"], float("nan"))
    te.dense_extend(batch["q"], batch["k"], batch["v"], k_cache, v_cache, out, batch["page_table"],
                    batch["seq_lens"], batch["qo_indptr"], SCALE, write_loc=loc, zero_padding=True)
    ref, _, _ = run_attention(batch, "torch", decode=False, scale=SCALE)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for new, cache, old in ((batch["k"], k_cache, before[0]), (batch["v"], v_cache, before[1])):
        flat, flat_old = cache.view(-1, *cache.shape[2:]), old.view(-1, *old.shape[2:])
        live = loc[loc != 0]
        assert torch.equal(flat[live], new[: live.shape[0]]), "a live row is not at its slot"
        assert (flat[0][None] == new[loc == 0]).all(-1).all(-1).any(), "the null slot holds no padding row"
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(flat[untouched], flat_old[untouched]), "a slot outside write_loc changed"


def test_without_write_loc_or_zero_padding_the_dense_kernel_leaves_both_alone(small_tiles):
    """The sweep's and the old callers' contract: no cache write, padding rows not stored."""
    batch = padded_step([6], [6], tail_rows=10, empty_requests=1, head_dim=64, seed=2)
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    out = torch.full_like(batch["q"], float("nan"))
    te.dense_extend(batch["q"], batch["k"], batch["v"], k_cache, v_cache, out, batch["page_table"],
                    batch["seq_lens"], batch["qo_indptr"], SCALE)
    assert torch.equal(k_cache, batch["k_cache"]) and torch.equal(v_cache, batch["v_cache"])
    assert out[6:].isnan().all() and not out[:6].isnan().any()


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_triton_op_adds_no_aten_zeroing_and_the_torch_op_keeps_it(small_tiles):
    """``run_attention`` zeroes the padding rows itself (arange, ge, masked_fill_) only for impls
    that do not: the Triton extend issues no aten op on the device besides its kernels."""
    from tscompile.custom_ops.attention import run_attention as op_body

    batch = padded_step([5], [9], tail_rows=11, empty_requests=1, head_dim=64, seed=5)

    def ops(impl):
        out = torch.zeros_like(batch["q"])
        kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
        with _AtenOps() as mode:
            op_body(batch["q"], batch["k"], batch["v"], kc, vc, out, batch["page_table"], batch["seq_lens"],
                    batch["qo_indptr"], batch["write_loc"], SCALE, False, impl)
        return mode.ops

    triton_ops = ops("triton")
    assert not {"masked_fill_", "arange", "ge"} & set(triton_ops), triton_ops
    assert "masked_fill_" in ops("torch")
