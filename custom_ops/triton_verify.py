"""Triton attention of a speculative verify window: N query rows per request over the paged cache.

A verify step is the decode step widened: request b has N new rows (its last N positions,
``seq_lens[b] - N .. seq_lens[b] - 1``), each attending to the whole cached prefix and causally
inside the window. The kernel is the split-KV decode kernel with N * GQA-group rows per program
instead of the group alone: program (b, kvh, split) loads the N rows of every query head of KV
head kvh, runs the shared online-softmax tile step (``_attend_paged_tile``, causal, masked) over its
split's KV range, and writes a partial that the decode combine kernel merges (its grid is simply
over B * N rows). Grids come from static shapes only, so it replays under a CUDA graph.

    q, out:      [B * N, Hq, D]   request-major, row b * N + i is request b's i-th window row
    k_cache:     [num_pages, P, Hkv, D]   (the window's K/V already written)
    page_table:  [B, max_pages] int32;  seq_lens: [B] int32 (0: a padded request, output zeros)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tscompile.custom_ops import triton_attention as ta
from tscompile.utils import cdiv

# Keys per tile, per head_dim: the decode kernel's tile sizes (64 keys up to head_dim 128).
VERIFY_BLOCK_N: dict[int, int] = {16: 64, 32: 64, 64: 64, 128: 64, 256: 32}
_TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs: split a small batch's KV until it fills them
_MAX_SPLITS = 16
_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the combine than it saves


@triton.jit
def _verify_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    k_ptr, v_ptr, loc_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kcp, stride_kco, stride_kch, stride_kcd,
    stride_vcp, stride_vco, stride_vch, stride_vcd,
    stride_ptb, stride_ptp,
    stride_ot, stride_oh, stride_od,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    max_kv,
    WIDTH: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    WRITE_KV: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (B, Hkv, NUM_SPLITS). Tile row r is window row i = r // GROUP_PAD, head g = r % GROUP_PAD
    (rows past WIDTH * GROUP_PAD pad the tile to what ``tl.dot`` needs and are masked out).

    Writes part_out [B * N, Hq, NUM_SPLITS, D] fp32 and part_lse [B * N, Hq, NUM_SPLITS] fp32 (log2
    units, -inf for a split a row sees nothing of); with one split, ``out`` itself.

    WRITE_KV: first write the window's new K/V rows of KV head kvh (k, v at ``loc``, row b * N + i)
    whose positions fall in this split's range, then wait for the whole program (a CTA barrier)
    before its tiles read them. Only this split's programs read those positions, and each reads its
    own KV head, so no program reads a row another writes. A padded request (KV length 0) writes
    nothing. PDL: everything below may depend on the kernel before (``decode_pdl``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len, split_len, lo, hi = ta._split_range(seq_lens_ptr, b, split, max_kv, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    if WRITE_KV:
        for w in tl.static_range(WIDTH):
            pos = kv_len - WIDTH + w
            if (pos >= lo) & (pos < hi):
                ta._write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, b * WIDTH + w, kvh,
                                 stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                                 stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch,
                                 stride_vcd, HEAD_DIM, PAGE_SIZE)
        tl.debug_barrier()

    r = tl.arange(0, ROWS)
    i = r // GROUP_PAD
    g = r % GROUP_PAD
    row_live = (i < WIDTH) & (g < GROUP)
    heads = kvh * GROUP + g
    tok = b.to(tl.int64) * WIDTH + i
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_live[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = kv_len - WIDTH + i  # [ROWS]; the window's last row sees the whole KV

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = ta._attend_paged_tile(
            q, q_pos, m_i, l_i, acc, start, hi, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=True, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # a row that saw nothing (padded request): zeros
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_live[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        part = (tok * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split  # [B * N, Hq, NUM_SPLITS]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=row_live[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_live)


def verify_num_splits(max_kv: int, batch: int, num_kv_heads: int, block_n: int) -> int:
    """Static split count: enough programs to fill the GPU, no split shorter than the minimum."""
    min_split = cdiv(_MIN_SPLIT_TOKENS, block_n) * block_n
    by_length = cdiv(max_kv, min_split)
    by_occupancy = cdiv(_TARGET_PROGRAMS, max(batch * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def paged_verify(q, k_cache, v_cache, out, page_table, seq_lens, scale: float, *, new_kv=None, pdl: bool = False,
                 num_splits: int | None = None, block_n: int | None = None) -> None:
    """Attention of N = T / B window rows per request (shapes in the module docstring). The K/V
    write is the caller's, or, with ``new_kv = (k, v, write_loc)`` (``[B * N, Hkv, D]`` twice and
    ``[B * N]``), the split kernel's. ``pdl``: the split and combine kernels launch with
    programmatic dependent launch where the device has it. ``num_splits`` / ``block_n``: override the
    launch choice (tests use it to cover one and several splits on small shapes)."""
    t, hq, d = q.shape
    bs = page_table.shape[0]
    if t == 0 or bs == 0:
        return
    width = t // bs
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    group_pad = ta._next_pow2(group)
    rows = max(16, ta._next_pow2(width) * group_pad)
    max_kv = page_table.shape[1] * page_size
    block_n = block_n or VERIFY_BLOCK_N[d]
    splits = num_splits or verify_num_splits(max_kv, bs, hkv, block_n)
    min_split = block_n if num_splits else cdiv(_MIN_SPLIT_TOKENS, block_n) * block_n
    if splits > 1:
        part_out = torch.empty(t, hq, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)
    else:  # the split kernel writes out itself
        part_out = part_lse = out
    if new_kv is not None:
        for name, rows_of in (("k", new_kv[0].shape[0]), ("v", new_kv[1].shape[0]), ("write_loc", new_kv[2].shape[0])):
            if rows_of != t:
                raise ValueError(f"tscompile: a verify window that writes its K/V rows in the attention kernel "
                                 f"needs one {name} row per query row: {name} has {rows_of} rows, q has {t}")
    k, v, write_loc = new_kv if new_kv is not None else (q, q, seq_lens)  # not read without WRITE_KV
    _verify_split_kernel[(bs, hkv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse, out, k, v, write_loc,
        scale * 1.4426950408889634,  # log2 units: the tiles use exp2
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), *out.stride(),
        *k.stride(), *v.stride(),
        max_kv,
        WIDTH=width, GROUP=group, GROUP_PAD=group_pad, ROWS=rows, HEAD_DIM=d, PAGE_SIZE=page_size,
        NUM_HEADS=hq, NUM_SPLITS=splits, MIN_SPLIT=min_split, BLOCK_N=block_n,
        DOT_PRECISION=ta._dot_precision(q.dtype), DOT_FP32=ta._dot_fp32(q.dtype), WRITE_KV=new_kv is not None,
        **ta.pdl_launch(q.device, pdl),
    )
    if splits > 1:
        # the decode combine, over B * N rows instead of B: its partial layout is this kernel's
        ta._decode_combine_kernel[(t, hq)](
            part_out, part_lse, out, *out.stride(),
            NUM_HEADS=hq, NUM_SPLITS=splits, SPLITS_PAD=max(2, ta._next_pow2(splits)), HEAD_DIM=d,
            **ta.pdl_launch(q.device, pdl),
        )


ta.register_verify_attention(paged_verify)
