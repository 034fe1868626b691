"""The verify window of width N (N query rows per request; N = 1 is plain decode): the decode
metadata refresh and the attention of every CPU-runnable backend, against float64 oracles.

Every check builds fresh random inputs and poisons the outputs (NaN / -7) before the kernels write.
Triton runs under the interpreter on the CPU (conftest), so shapes stay small."""

from __future__ import annotations

import pytest
import torch

from helpers import dense_reference, random_paged_batch
from tscompile.custom_ops.metadata import torch_refresh
from tscompile.custom_ops.triton_metadata import triton_refresh
from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops.triton_verify import paged_verify
from tscompile.kv_cache.slots import slot_from_block_table

SCALE = 0.3


# ---------------------------------------------------------------------------------------------
# refresh


def _refresh_inputs(n, bs, width, *, max_blocks=4, pages_per_block=2, page_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max_blocks * pages_per_block
    blocks = (torch.randperm(60, generator=g)[: n * max_blocks] + 1).view(n, max_blocks).to(torch.int32)
    seq_lens = torch.randint(width, max_pages * page_size + 1, (n,), generator=g).to(torch.int32)
    block_size = pages_per_block * page_size
    used = (seq_lens.long() + block_size - 1) // block_size  # blocks past a request's length are null
    blocks = torch.where(torch.arange(max_blocks)[None, :] < used[:, None], blocks, 0).to(torch.int32)
    outs = (torch.full((bs, max_pages), -7, dtype=torch.int32), torch.full((bs,), -7, dtype=torch.int32),
            torch.full((bs * width,), -7, dtype=torch.int64))
    return blocks, seq_lens, outs, pages_per_block, page_size


def _expected_write_locs(blocks, seq_lens, bs, width, block_size):
    """Slots straight from the scheduler's block table (the router's check), padding -> 0."""
    expect = torch.zeros(bs * width, dtype=torch.int64)
    for i in range(seq_lens.shape[0]):
        positions = torch.arange(int(seq_lens[i]) - width, int(seq_lens[i]))
        rows = blocks[i:i + 1].expand(width, -1)
        expect[i * width:(i + 1) * width] = slot_from_block_table(rows, positions, block_size)
    return expect


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("n,bs,width", [(3, 3, 1), (3, 5, 1), (2, 4, 3), (4, 4, 5), (1, 6, 2), (0, 3, 4)])
def test_refresh_window_slots_lengths_and_padding(impl, n, bs, width, device):
    blocks, seq_lens, outs, r, p = _refresh_inputs(n, bs, width, seed=10 * n + bs + width)
    pt, sl, wl = (o.to(device) for o in outs)
    torch.ops.tscompile.refresh_decode_metadata(blocks.to(device), seq_lens.to(device), pt, sl, wl, r, p, impl, width)
    pt, sl, wl = pt.cpu(), sl.cpu(), wl.cpu()
    assert torch.equal(wl, _expected_write_locs(blocks, seq_lens, bs, width, r * p))
    assert sl[:n].tolist() == seq_lens.tolist() and sl[n:].tolist() == [0] * (bs - n)
    assert torch.equal(pt[n:], torch.zeros_like(pt[n:]))
    for i in range(n):  # page c of request i: page c % r of its block c // r (null block -> page 0)
        block = blocks[i].long().repeat_interleave(r)
        pages = torch.where(block > 0, block * r + torch.arange(pt.shape[1]) % r, 0)
        assert pt[i].tolist() == pages.tolist()


def test_refresh_width_default_is_plain_decode(device):
    """The old eight-argument call is the width-1 call, bit for bit."""
    blocks, seq_lens, outs, r, p = _refresh_inputs(3, 5, 1, seed=4)
    blocks, seq_lens = blocks.to(device), seq_lens.to(device)
    outs = tuple(o.to(device) for o in outs)
    outs_w = tuple(o.clone() for o in outs)
    torch.ops.tscompile.refresh_decode_metadata(blocks, seq_lens, *outs, r, p, "torch")
    torch.ops.tscompile.refresh_decode_metadata(blocks, seq_lens, *outs_w, r, p, "triton", 1)
    for a, b in zip(outs, outs_w):
        assert torch.equal(a, b)


def test_refresh_triton_matches_torch_on_random_windows(device):
    for seed in range(3):
        width = seed + 2
        blocks, seq_lens, outs, r, p = _refresh_inputs(5, 7, width, max_blocks=3, pages_per_block=1,
                                                       page_size=2, seed=seed)
        blocks, seq_lens, outs = blocks.to(device), seq_lens.to(device), tuple(o.to(device) for o in outs)
        outs_t = tuple(o.clone() for o in outs)
        torch_refresh(blocks, seq_lens, *outs, r, p, width)
        triton_refresh(blocks, seq_lens, *outs_t, r, p, width)
        for a, b in zip(outs, outs_t):
            assert torch.equal(a, b)


def test_opcheck_refresh_with_width():
    blocks, seq_lens, outs, r, p = _refresh_inputs(2, 4, 3, seed=5)
    torch.library.opcheck(torch.ops.tscompile.refresh_decode_metadata.default,
                          (blocks, seq_lens, *outs, r, p, "torch", 3))


@pytest.mark.parametrize("width,rows", [(0, 4), (2, 4), (3, 7)])
def test_refresh_refuses_a_width_the_buffers_do_not_hold(width, rows):
    blocks, seq_lens, (pt, sl, _), r, p = _refresh_inputs(2, 4, 1, seed=6)
    wl = torch.full((rows,), -7, dtype=torch.int64)
    with pytest.raises(ValueError, match="tscompile: refresh_decode_metadata"):
        torch.ops.tscompile.refresh_decode_metadata(blocks, seq_lens, pt, sl, wl, r, p, "torch", width)


# ---------------------------------------------------------------------------------------------
# attention


def window_batch(width, kv_lens, *, pad_requests=0, **kw):
    """``random_paged_batch`` with N rows per request, plus ``pad_requests`` padded requests of N
    rows each (KV length 0, the null page table row, write slot 0)."""
    batch = random_paged_batch([width] * len(kv_lens), kv_lens, **kw)
    if pad_requests:
        g = torch.Generator().manual_seed(kw.get("seed", 0) + 1000)
        extra = pad_requests * width
        for name in ("q", "k", "v"):
            t = batch[name]
            batch[name] = torch.cat([t, torch.randn(extra, *t.shape[1:], generator=g).to(t.dtype)])
        pt = batch["page_table"]
        batch["page_table"] = torch.cat([pt, torch.zeros(pad_requests, pt.shape[1], dtype=pt.dtype)])
        batch["seq_lens"] = torch.cat([batch["seq_lens"], torch.zeros(pad_requests, dtype=torch.int32)])
        batch["write_loc"] = torch.cat([batch["write_loc"], torch.zeros(extra, dtype=torch.int64)])
    b = batch["page_table"].shape[0]
    batch["qo_indptr"] = (torch.arange(b + 1) * width).to(torch.int32)
    return batch


def _on(batch, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _run(batch, impl):
    out = torch.full_like(batch["q"], float("nan"))
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    torch.ops.tscompile.attention(batch["q"], batch["k"], batch["v"], k_cache, v_cache, out, batch["page_table"],
                                  batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], SCALE, True, impl)
    return out, k_cache, v_cache


CASES = [  # (width, kv_lens, page_size, num_kv_heads, group, pad_requests)
    (1, [5, 9, 1], 4, 2, 2, 1),
    (2, [2, 7, 16], 4, 2, 2, 0),
    (3, [3, 17, 8, 12], 4, 1, 4, 2),
    (4, [4, 9], 1, 2, 3, 1),
    (5, [33, 5, 21], 8, 2, 1, 0),
    (5, [70], 16, 1, 8, 3),
]


@pytest.mark.parametrize("width,kv_lens,page_size,hkv,group,pad", CASES)
def test_torch_window_attention_matches_dense_float64(width, kv_lens, page_size, hkv, group, pad):
    batch = window_batch(width, kv_lens, pad_requests=pad, page_size=page_size, num_kv_heads=hkv, group=group,
                         seed=width * 7 + len(kv_lens))
    out, k_cache, _ = _run(batch, "torch")
    assert not out.isnan().any()
    ref = dense_reference(batch, SCALE)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    flat = k_cache.view(-1, *k_cache.shape[2:])
    live = batch["seq_lens"].shape[0] - pad
    rows = width * live
    assert torch.equal(flat[batch["write_loc"][:rows]], batch["k"][:rows])


def test_window_attention_equals_extend_of_the_same_rows():
    """A verify window is an extend whose every request has N rows: both torch paths agree."""
    batch = window_batch(3, [6, 11, 3], page_size=2, seed=3)
    out, _, _ = _run(batch, "torch")
    ref = torch.full_like(batch["q"], float("nan"))
    torch.ops.tscompile.attention(batch["q"], batch["k"], batch["v"], batch["k_cache"].clone(),
                                  batch["v_cache"].clone(), ref, batch["page_table"], batch["seq_lens"],
                                  batch["qo_indptr"], batch["write_loc"], SCALE, False, "torch")
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_decode_refuses_rows_that_are_not_whole_windows():
    batch = window_batch(2, [4, 5], page_size=4, seed=2)
    q = batch["q"][:3]
    with pytest.raises(ValueError, match="tscompile: a decode attention call has 3 query rows for 2 requests"):
        torch.ops.tscompile.attention(q, batch["k"][:3], batch["v"][:3], batch["k_cache"], batch["v_cache"],
                                      torch.empty_like(q), batch["page_table"], batch["seq_lens"],
                                      batch["qo_indptr"], batch["write_loc"][:3], SCALE, True, "torch")


def test_opcheck_window_attention():
    batch = window_batch(3, [4, 7], page_size=2, seed=8)
    out = torch.zeros_like(batch["q"])
    args = (batch["q"], batch["k"], batch["v"], batch["k_cache"].clone(), batch["v_cache"].clone(), out,
            batch["page_table"], batch["seq_lens"], batch["qo_indptr"], batch["write_loc"], SCALE, True, "torch")
    torch.library.opcheck(torch.ops.tscompile.attention.default, args)


TRITON_CASES = [  # (width, kv_lens, page_size, num_kv_heads, group, pad, num_splits)
    (1, [5, 9], 4, 2, 2, 1, None),
    (2, [2, 19, 16], 4, 2, 2, 0, 3),
    (3, [3, 40], 1, 1, 4, 1, 2),
    (4, [4, 9, 30], 8, 2, 1, 0, 1),
    (5, [37, 6], 16, 1, 2, 2, 4),
    (3, [9, 21], 4, 2, 3, 1, 2),
]


@pytest.mark.parametrize("width,kv_lens,page_size,hkv,group,pad,splits", TRITON_CASES)
def test_triton_window_matches_torch(width, kv_lens, page_size, hkv, group, pad, splits, device):
    batch = _on(window_batch(width, kv_lens, pad_requests=pad, page_size=page_size, num_kv_heads=hkv, group=group,
                             seed=width * 13 + len(kv_lens)), device)
    ref, ref_k, ref_v = _run(batch, "torch")
    if splits is None:  # the op's own dispatch (width 1: the decode kernel; else the verify kernel)
        out, k_cache, v_cache = _run(batch, "triton")
    else:  # force one or several splits on these small shapes (block_n 16: several tiles per split)
        out = torch.full_like(batch["q"], float("nan"))
        k_cache, v_cache = ref_k, ref_v  # the torch run wrote the window's K/V already
        paged_verify(batch["q"], k_cache, v_cache, out, batch["page_table"], batch["seq_lens"], SCALE,
                     num_splits=splits, block_n=16)
    assert not out.isnan().any(), "some output row was never written"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache[1:], ref_k[1:]) and torch.equal(v_cache[1:], ref_v[1:])  # page 0: null page


FUSED_CASES = [  # (width, kv_lens, page_size, num_kv_heads, group, pad, num_splits, block_n)
    (4, [7, 40, 33], 4, 2, 2, 1, 3, 16),  # split boundaries at 16 and 32: a window straddles each
    (3, [17, 5], 1, 1, 4, 2, 2, 16),
    (2, [9, 30], 8, 2, 1, 0, 1, 16),
    (5, [21, 6, 48], 4, 2, 3, 1, 4, 16),
]


@pytest.mark.parametrize("width,kv_lens,page_size,hkv,group,pad,splits,block_n", FUSED_CASES)
def test_triton_window_writing_its_own_rows_equals_the_write_then_attend(width, kv_lens, page_size, hkv, group, pad,
                                                                         splits, block_n, device):
    """``KernelPolicy.fused_verify_attention``: the split kernel writes each window row in the split
    whose range holds its position (windows straddling split boundaries included), then attends. The
    cache equals the torch op's write on every page but the null page (padding requests write
    nothing), and the output equals the torch oracle; the cache starts as random data."""
    batch = _on(window_batch(width, kv_lens, pad_requests=pad, page_size=page_size, num_kv_heads=hkv, group=group,
                             seed=width * 17 + len(kv_lens)), device)
    ref, ref_k, ref_v = _run(batch, "torch")
    out = torch.full_like(batch["q"], float("nan"))
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    rows = batch["write_loc"][: width * len(kv_lens)]
    assert not torch.equal(k_cache.view(-1, *k_cache.shape[2:])[rows], ref_k.view(-1, *ref_k.shape[2:])[rows])
    paged_verify(batch["q"], k_cache, v_cache, out, batch["page_table"], batch["seq_lens"], SCALE,
                 new_kv=(batch["k"], batch["v"], batch["write_loc"]), num_splits=splits, block_n=block_n)
    assert not out.isnan().any(), "some output row was never written"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache[1:], ref_k[1:]) and torch.equal(v_cache[1:], ref_v[1:])
    assert torch.equal(k_cache[0], batch["k_cache"][0])  # the null page: no padding row wrote it


def test_the_fused_verify_impl_runs_windows_through_the_writing_kernel(device):
    """Through the op: ``triton/fused_verify=1`` launches no separate K/V write for a window and
    equals the torch oracle; a plain decode (width 1) under the same impl is unchanged."""
    batch = _on(window_batch(3, [10, 4], pad_requests=1, page_size=4, seed=23), device)
    ref, ref_k, _ = _run(batch, "torch")
    writes = []
    real = ta.write_kv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ta, "write_kv", lambda *a: writes.append(1) or real(*a))
        out, k_cache, _ = _run(batch, "triton/fused_verify=1")
        assert writes == []
        _run(batch, "triton")
        assert writes == [1]  # the default impl still writes first
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache[1:], ref_k[1:])


def test_a_fused_write_refuses_k_rows_that_are_not_the_windows():
    batch = window_batch(2, [4, 5], page_size=4, seed=4)
    with pytest.raises(ValueError, match=r"^tscompile: a verify window that writes its K/V rows in the attention "
                                         r"kernel needs one k row per query row: k has 3 rows, q has 4"):
        paged_verify(batch["q"], batch["k_cache"], batch["v_cache"], torch.empty_like(batch["q"]),
                     batch["page_table"], batch["seq_lens"], SCALE,
                     new_kv=(batch["k"][:3], batch["v"], batch["write_loc"]))


def test_triton_op_dispatches_windows_to_the_verify_kernel(device):
    batch = _on(window_batch(3, [10, 4], pad_requests=1, page_size=4, seed=21), device)
    ref, ref_k, _ = _run(batch, "torch")
    out, k_cache, _ = _run(batch, "triton")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # page 0 is the null page every padding row writes: which write lands last is the kernels' race
    assert torch.equal(k_cache[1:], ref_k[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton/fused_verify=1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,width", [(1, 4), (32, 4), (8, 2), (4, 6)])
def test_gpu_triton_window_llama8b_shape(bs, width, dtype, impl):
    """llama-8b's attention shape (32 query / 8 KV heads of 128, page 16), contexts of hundreds to
    thousands of positions, against the torch oracle on the same inputs; ``triton/fused_verify=1``:
    the split kernels write the window's rows themselves (a CTA barrier before their tiles read
    them) and launch with PDL."""
    g = torch.Generator().manual_seed(bs * 10 + width)
    kv_lens = torch.randint(width, 2100, (bs,), generator=g).tolist()
    batch = _on(window_batch(width, kv_lens, pad_requests=2, page_size=16, num_kv_heads=8, group=4, head_dim=128,
                             dtype=dtype, seed=bs + width), "cuda")
    ref, ref_k, _ = _run(batch, "torch")
    out, k_cache, _ = _run(batch, impl)
    assert not out.isnan().any()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert torch.equal(k_cache[1:], ref_k[1:])  # all but the null page, which padding rows race to write


def test_speculative_greedy_with_the_fused_verify_attention_equals_plain_decode():
    """``compile_options={"kernels": {"fused_verify_attention": True}}`` reaches the compiled verify
    step's Triton attention (the leaves' impl name), and n-gram speculation through it, rejected
    drafts included, gives plain decode's greedy tokens (float32, CPU: the Triton interpreter)."""
    import tscompile

    kw = dict(device="cpu", dtype=torch.float32, max_model_len=64, max_num_seqs=2, page_size=4)
    prompts = [[(5 * i + j) % 50 + 3 for j in range(6)] * 2 for i in range(2)]
    params = tscompile.SamplingParams(max_tokens=12, temperature=0.0)
    plain = tscompile.LLM("llama-tiny", attention_backend="torch", enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = tscompile.LLM("llama-tiny", attention_backend="triton",
                        compile_options={"kernels": {"fused_verify_attention": True}},
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **kw)
    assert {leaf.impl for leaf in llm.runner.decode.attention.child_backends()} == {"triton/fused_verify=1"}
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats()
    assert got == want
    assert stats.spec_verify_steps > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
