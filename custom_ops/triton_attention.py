"""The ``triton`` implementation of ``tscompile::attention``: paged KV write, split-KV decode, extend.

Three kernels (plus a split combiner), all launched with grids that depend only on static shapes,
and none of them reads a tensor value on the host. That makes every path CUDA-graph safe: the
same launches replay correctly whatever ``seq_lens`` / ``qo_indptr`` / ``page_table`` hold.
Decode runs the splits (the one holding a request's new position writes its K/V row first) and
their combine as two launches; ``paged_decode`` without ``new_kv`` (the KV write as a launch of its
own before them) gives bitwise-identical results (GPU-tested on the H200 at 2 and 4 warps) and is
what the tests compare against. A third form, all of it in one kernel whose last-arriving split
combined, was measured slower and removed (below).

Layout (the op contract, see ``custom_ops/attention.py``):
    q:          [T, Hq, D]             float32 / bfloat16 / float16, any strides
    k, v:       [T, Hkv, D]            same dtypes, any strides (v is usually a view of a fused qkv)
    k_cache:    [num_pages, P, Hkv, D] same dtypes; flat slot s = page * P + offset
    v_cache:    [num_pages, P, Hkv, D]
    out:        [T, Hq, D]
    page_table: [B, max_pages] int32   (null page 0 for unused entries)
    seq_lens:   [B] int32              KV length of each request after this forward's writes
    qo_indptr:  [B + 1] int32
    write_loc:  [T] int64

GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Every attention program handles *all*
query heads of one KV head, so a KV tile is loaded once per group instead of once per query head.

Accumulation is float32 throughout (scores, softmax statistics, the output accumulator). Matrix
products run with ``tl.dot``; for float32 inputs it is asked for IEEE precision so an fp32 run is
not silently done in TF32 on GPUs.

Supported: head_dim a power of two in [16, 256]; dtypes float32, bfloat16, float16. Anything else
raises ``ValueError('tscompile: ...')`` before a kernel is launched.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
import triton
import triton.language as tl

from tscompile.custom_ops.attention import register_attention_impl
from tscompile.utils import cdiv


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

# Decode split-KV tuning. The number of splits (the grid) is a function of static shapes only (the
# table's KV capacity ``max_pages * P``, the batch and the KV head count), so a captured graph
# stays valid; each request's split length is computed in the kernel from its own ``seq_len``, so
# the work spreads over every split whatever the length (a 640-token request in a 4096-token table
# gets 10 one-tile splits, not 3 four-tile ones). Module-level so tests can shrink
# DECODE_MIN_SPLIT_TOKENS and DECODE_BLOCK_N to exercise many splits on tiny shapes.
DECODE_MIN_SPLIT_TOKENS = 64  # no split shorter than this (a whole number of tiles)
# Enough programs (batch * kv heads * splits) to fill a large GPU; None: the measured choice per
# shape (``_decode_target_programs``), a number overrides it (tests, launch sweeps).
DECODE_TARGET_PROGRAMS: int | None = None
DECODE_MAX_SPLITS = 32
# Keys per tile (split lengths are whole tiles) and the split kernel's warps / pipeline stages (the
# warps are the combine kernel's too, so its sums match a one-split launch's in-kernel combine). None:
# the measured choice per shape (``_decode_block_n``, ``_decode_launch_options``); a number overrides
# it for every shape (tests shrink the tile; a launch sweep times other settings).
DECODE_BLOCK_N: int | None = None


DECODE_NUM_WARPS: int | None = None
DECODE_NUM_STAGES: int | None = None
# From the H200 (llama-8b's decode shape: 32 query / 8 KV heads of 128, 576-token contexts in a
# 2064-position table), a launch sweep found
# 32-key tiles faster than 64 at bs 8, 32 and 64 (split + combine per layer 14.0 -> 12.0, 30.2 -> 27.9,
# 46.3 -> 43.8 us), and with 256 or more (request, KV head) programs 2 warps faster than 4 (more
# programs resident per SM for the long per-split loops; with fewer the splits are short and 4 warps
# win). In the bench's kernel tables the split kernel per step went 357 -> 295 us at bs=8, 812 -> 729
# at 32 and 1397 -> 1307 at 64, but 153 -> 170 at bs=1 (8 programs, two-tile splits): below 64
# programs the 64-key tile stays. head_dim 64 (llama-1b's decode shape, 16 layers per graph; swept
# on the H200): its 64-key tile stays, and 2 warps beat Triton's
# 4 from 64 programs (split + combine per layer, 4 warps -> 2: bs=8 9.41 -> 8.26 us, bs=32 16.75 ->
# 16.20, bs=64 29.55 -> 26.57); at bs=1 (8 programs) 4 stay. Other head dims keep Triton's defaults
# (head_dim 256 always takes 32-key tiles: registers, shared memory).
#
# head_dim 128 from 512 programs (bs >= 64 of 8 KV heads): one split (no combine launch) of 64-key
# tiles at 4 warps and 3 stages. A second sweep (us per layer)
# put it at 41.04 against 45.34 for the launch above, and in the engine, one H200, back-to-back
# processes, llama-8b bs=64 TPOT went 6.358 -> 6.233 ms. The same sweep's
# picks below 512 programs (2 warps + 2 stages at bs=8: 13.00 -> 11.73 us; 4 warps + two splits at
# bs=32: 28.14 -> 26.76) were slower in the engine (bs=8 4.743 -> 4.776 ms, bs=32 5.425 -> 5.468),
# so the first sweep's launch stays there.
DECODE_SHORT_TILE_FROM_PROGRAMS = 64
DECODE_WARPS_2_FROM_PROGRAMS = 256
DECODE_WARPS_2_FROM_PROGRAMS_D64 = 64
DECODE_ONE_SPLIT_FROM_PROGRAMS_D128 = 512
DECODE_DEFAULT_TARGET_PROGRAMS = 1024


def _one_split_launch(head_dim: int | None, programs: int) -> bool:
    return head_dim == 128 and programs >= DECODE_ONE_SPLIT_FROM_PROGRAMS_D128


def _decode_block_n(head_dim: int, programs: int) -> int:
    """Keys per tile for ``programs`` = batch x KV heads (static shapes only: a captured graph's
    launch never changes)."""
    if DECODE_BLOCK_N is not None:
        return min(DECODE_BLOCK_N, 32) if head_dim >= 256 else DECODE_BLOCK_N
    if _one_split_launch(head_dim, programs):
        return 64
    if head_dim >= 256 or (head_dim == 128 and programs >= DECODE_SHORT_TILE_FROM_PROGRAMS):
        return 32
    return 64


def _decode_launch_options(batch: int, num_kv_heads: int, head_dim: int) -> dict:
    warps, stages = DECODE_NUM_WARPS, DECODE_NUM_STAGES
    programs = batch * num_kv_heads
    if _one_split_launch(head_dim, programs):
        warps = 4 if warps is None else warps
        stages = 3 if stages is None else stages
    elif warps is None and ((head_dim == 128 and programs >= DECODE_WARPS_2_FROM_PROGRAMS)
                            or (head_dim == 64 and programs >= DECODE_WARPS_2_FROM_PROGRAMS_D64)):
        warps = 2
    return {k: v for k, v in (("num_warps", warps), ("num_stages", stages)) if v is not None}


def _decode_target_programs(head_dim: int | None, programs: int) -> int:
    """The programs (batch x KV heads x splits) the split count aims for: one split's worth for the
    one-split launch, else enough to fill a large GPU."""
    if DECODE_TARGET_PROGRAMS is not None:
        return DECODE_TARGET_PROGRAMS
    if _one_split_launch(head_dim, programs):
        return programs
    return DECODE_DEFAULT_TARGET_PROGRAMS


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def check_supported(head_dim: int, dtype: torch.dtype, what: str = "triton attention") -> None:
    """Raise ``ValueError('tscompile: ...')`` if the kernels cannot run this geometry."""
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0):
        raise ValueError(
            f"tscompile: {what} does not support head_dim {head_dim}; supported: powers of two in "
            f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (e.g. 64, 128)"
        )
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"tscompile: {what} does not support dtype {dtype}; supported: {names}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_inputs(q, k, v, k_cache, v_cache, out) -> None:
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    check_supported(d, k_cache.dtype)
    for name, t in (("q", q), ("k", k), ("v", v), ("v_cache", v_cache), ("out", out)):
        if t.dtype not in SUPPORTED_DTYPES:
            check_supported(d, t.dtype, f"triton attention ({name})")
    if hq % hkv:
        raise ValueError(f"tscompile: triton attention needs Hq % Hkv == 0, got Hq={hq}, Hkv={hkv}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"tscompile: triton attention needs CUDA tensors (got device {q.device.type}); on CPU set "
            "TRITON_INTERPRET=1 before triton is imported"
        )


def _dot_fp32(dtype: torch.dtype) -> bool:
    """Run the tile products in float32 (q is upcast once; k, p, v follow q's dtype). Only done for
    bfloat16 under the CPU interpreter, whose bfloat16 ``tl.dot`` returns garbage (triton 3.9);
    compiled GPU kernels keep 16-bit products."""
    return dtype == torch.bfloat16 and _interpreting()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 products: IEEE (the default would be TF32 on tensor cores). 16-bit products: ignored.
    return "ieee" if dtype == torch.float32 or _dot_fp32(dtype) else "tf32"


# ----------------------------------------------------------------------------------------------
# a. KV write


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kco, stride_kch, stride_kcd,
    stride_vcp, stride_vco, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """One program per new row t: copy k[t], v[t] ([Hkv, D]) to slot write_loc[t] of both caches."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_KV_HEADS)[:, None]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + page * stride_kcp + off * stride_kco + h[:, None] * stride_kch + d[None, :] * stride_kcd
    vc = v_cache_ptr + page * stride_vcp + off * stride_vco + h[:, None] * stride_vch + d[None, :] * stride_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k, v, k_cache, v_cache, write_loc) -> None:
    """Scatter ``k, v [T, Hkv, D]`` into ``k_cache, v_cache [num_pages, P, Hkv, D]`` at flat slots
    ``write_loc [T] int64``, cast to the cache dtype. Duplicate slots (padded rows all write the null
    slot 0) are fine: whichever row lands last wins, and nobody reads the null page."""
    t, hkv, d = k.shape
    if t == 0:
        return
    _kv_write_kernel[(t,)](
        k, v, k_cache, v_cache, write_loc,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_next_pow2(hkv), PAGE_SIZE=k_cache.shape[1],
    )


# ----------------------------------------------------------------------------------------------
# b. decode: split-KV partials, then a log-sum-exp combine


@triton.jit
def _attend_paged_tile(
    q, q_pos, m_i, l_i, acc, start, hi, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
    stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the query rows ``q`` over KV positions [start, start + BLOCK_N)
    (those below ``hi``) of one request's paged cache; returns the updated (m_i, l_i, acc).
    CAUSAL: row r sees only positions <= q_pos[r]. MASKED=False: the caller guarantees the whole
    tile is below ``hi`` and visible to every row (the bulk of a long prompt), so no mask is built.
    Shared by the decode and extend kernels."""
    pos = start + tl.arange(0, BLOCK_N)
    # Per-token page lookup: works for every page size, including P = 1 and P > BLOCK_N.
    off = pos % PAGE_SIZE
    if MASKED:
        live = pos < hi
        page = tl.load(pt_row + (pos // PAGE_SIZE) * stride_ptp, mask=live, other=0).to(tl.int64)
        k = tl.load(k_cache_ptr + page[:, None] * stride_kcp + off[:, None] * stride_kco + kvh * stride_kch
                    + d[None, :] * stride_kcd, mask=live[:, None], other=0.0)
    else:
        page = tl.load(pt_row + (pos // PAGE_SIZE) * stride_ptp).to(tl.int64)
        k = tl.load(k_cache_ptr + page[:, None] * stride_kcp + off[:, None] * stride_kco + kvh * stride_kch
                    + d[None, :] * stride_kcd)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2  # [rows, BLOCK_N]
    if MASKED:
        if CAUSAL:
            visible = live[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = live[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + page[:, None] * stride_vcp + off[:, None] * stride_vco + kvh * stride_vch
                    + d[None, :] * stride_vcd, mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + page[:, None] * stride_vcp + off[:, None] * stride_vco + kvh * stride_vch
                    + d[None, :] * stride_vcd)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_partial(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, b, kvh, lo, hi, scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kcp, stride_kco, stride_kch, stride_kcd,
    stride_vcp, stride_vco, stride_vch, stride_vcd,
    stride_ptb, stride_ptp,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """The GROUP query heads of KV head kvh of request b over KV positions [lo, hi): returns
    (o [GROUP_PAD, HEAD_DIM] normalised, lse [GROUP_PAD] log2-sum-exp2, -inf when empty).
    Query rows are padded to GROUP_PAD (>= 16, what tl.dot needs); the pad rows are masked out."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    g_live = g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_live[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # k, p and v are cast to q's dtype below

    # Running max starts finite so a fully masked tile gives alpha = 1, p = 0 (no inf - inf NaNs).
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_paged_tile(
            q, 0, m_i, l_i, acc, start, hi, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def _split_range(seq_lens_ptr, b, split, max_kv, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """(kv_len, split_len, lo, hi): split ``split`` of request b covers KV positions [lo, hi), where
    L = max(ceil(kv_len / NUM_SPLITS) rounded up to whole tiles, MIN_SPLIT); hi <= lo: empty."""
    kv_len = tl.minimum(tl.load(seq_lens_ptr + b), max_kv)  # never read past the page table row
    split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    return kv_len, split_len, lo, hi


@triton.jit
def _writer_split(kv_len, split_len):
    """The split that writes request b's new K/V row when a decode kernel writes it itself: the one
    whose range holds the row's position kv_len - 1 (split 0 for kv_len 0, a padded row, which reads
    nothing and still writes its slot). Exactly one per request, since NUM_SPLITS * split_len >= kv_len.
    No other program reads that slot in the same launch, provided write_loc[b] is the slot of position
    kv_len - 1 in b's own page-table row and no two requests share a page they write (tscompile's pool
    shares none)."""
    return tl.maximum(kv_len - 1, 0) // split_len


@triton.jit
def _decode_split_kernel(
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
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_KV: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B, Hkv, NUM_SPLITS). Program (b, kvh, s) attends the GROUP query heads of KV head kvh
    of request b over its split s (``_split_range``). (The KV head fastest in the grid, so the Hkv
    programs of one position read its whole cache row together, gave the same bits and measured
    even on the H200.)

    Writes part_out [B, Hq, NUM_SPLITS, D] fp32 (the split's normalised output) and
    part_lse [B, Hq, NUM_SPLITS] fp32 (its log2-sum-exp2 of scaled scores; -inf for an empty split);
    with one split, the output itself (``_store_one_split``: the combine's arithmetic, no combine launch).

    WRITE_KV: first write request b's new K/V row (k, v at ``loc``): the
    ``_writer_split`` writes it, then waits for its whole program (a CTA barrier; every thread takes
    the same branch) before its tiles read that slot.
    """
    if PDL:  # KernelPolicy.decode_pdl: everything below may depend on the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len, split_len, lo, hi = _split_range(seq_lens_ptr, b, split, max_kv, NUM_SPLITS, MIN_SPLIT, BLOCK_N)
    if WRITE_KV:
        if split == _writer_split(kv_len, split_len):
            _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, b, kvh,
                          stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                          stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch,
                          stride_vcd, HEAD_DIM, PAGE_SIZE)
            tl.debug_barrier()
    o, lse = _decode_partial(
        q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, b, kvh, lo, hi, scale_log2,
        stride_qt, stride_qh, stride_qd, stride_kcp, stride_kco, stride_kch, stride_kcd,
        stride_vcp, stride_vco, stride_vch, stride_vcd, stride_ptb, stride_ptp,
        GROUP, GROUP_PAD, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION, DOT_FP32)
    if NUM_SPLITS == 1:
        _store_one_split(out_ptr, o, lse, b, kvh, stride_ot, stride_oh, stride_od, GROUP, GROUP_PAD, HEAD_DIM)
    else:
        _store_partial(part_out_ptr, part_lse_ptr, o, lse, b, kvh, split, GROUP, GROUP_PAD, HEAD_DIM, NUM_HEADS,
                       NUM_SPLITS)


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, o, lse, b, kvh, split, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
                   NUM_SPLITS: tl.constexpr):
    """Split ``split``'s (o, lse) of the GROUP heads of KV head kvh into part_out / part_lse."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    g_live = g < GROUP
    row = (b * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split  # [B, Hq, NUM_SPLITS] contiguous
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=g_live[:, None])
    tl.store(part_lse_ptr + row, lse, mask=g_live)


@triton.jit
def _store_one_split(out_ptr, o, lse, b, kvh, stride_ot, stride_oh, stride_od, GROUP: tl.constexpr,
                     GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The output of a launch with one split: ``_combine_head`` over that split (its pad split has
    weight 0) in registers: m = lse (0 when empty), w = 2^(lse - m), out = (o * w + 0) / (w + 0); the
    "+ 0" terms are the pad split's, kept so a -0.0 comes out as the combine's +0.0."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    m = tl.where(lse == float("-inf"), 0.0, lse)
    w = tl.exp2(lse - m)
    denom = w + 0.0
    res = (o * w[:, None] + 0.0) / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


@triton.jit
def _combine_head(part_out_ptr, part_lse_ptr, out_ptr, b, h, stride_ot, stride_oh, stride_od,
                  NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """out[b, h] = sum_s w_s * part_out[b, h, s] / sum_s w_s, w_s = 2^(lse_s - max lse).

    A request with no KV at all (seq_len 0, a padded row) has every lse = -inf: it gets exact zeros."""
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    s_live = s < NUM_SPLITS
    row = (b * NUM_HEADS + h).to(tl.int64) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s_live, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all empty: every weight below is 2^-inf = 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_live[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + d * stride_od,
             o.to(out_ptr.dtype.element_ty))


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (B, Hq): ``_combine_head`` of (b, h)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _combine_head(part_out_ptr, part_lse_ptr, out_ptr, tl.program_id(0), tl.program_id(1),
                  stride_ot, stride_oh, stride_od, NUM_HEADS, NUM_SPLITS, SPLITS_PAD, HEAD_DIM)


def _min_split(block_n: int) -> int:
    return cdiv(DECODE_MIN_SPLIT_TOKENS, block_n) * block_n


def decode_num_splits(max_kv: int, batch: int, num_kv_heads: int, block_n: int, head_dim: int | None = None) -> int:
    """Static split count: enough splits to fill the GPU, no more than a full table has minimum-length
    splits."""
    by_length = cdiv(max_kv, _min_split(block_n))
    programs = max(batch * num_kv_heads, 1)
    by_occupancy = cdiv(_decode_target_programs(head_dim, programs), programs)
    return max(1, min(by_length, by_occupancy, DECODE_MAX_SPLITS))


def _decode_launch(q, k_cache, page_table) -> tuple[int, int, int, int, int, int, dict]:
    """(page size, KV heads, GQA group, max KV positions, keys per tile, splits, launch options) of a
    decode launch."""
    bs, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    max_kv = page_table.shape[1] * page_size
    block_n = _decode_block_n(d, bs * hkv)
    return (page_size, hkv, hq // hkv, max_kv, block_n, decode_num_splits(max_kv, bs, hkv, block_n, d),
            _decode_launch_options(bs, hkv, d))


def paged_decode(q, k_cache, v_cache, out, page_table, seq_lens, scale, new_kv=None, pdl: bool = False) -> None:
    """One query row per request. q, out: [B, Hq, D]; page_table [B, max_pages]; seq_lens [B].
    Split kernel, then combine kernel; with one split, the split kernel alone (it
    writes ``out`` as the combine would). The K/V write is the caller's, or, with ``new_kv = (k, v,
    write_loc)``, the split kernel's. ``pdl``: both launch with programmatic dependent launch where
    the device has it (``KernelPolicy.decode_pdl``)."""
    bs, hq, d = q.shape
    if new_kv is not None:
        _check_one_row_per_request(bs, *new_kv)
    if bs == 0:
        return
    page_size, hkv, group, max_kv, block_n, num_splits, options = _decode_launch(q, k_cache, page_table)
    if num_splits > 1:
        part_out = torch.empty(bs, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bs, hq, num_splits, dtype=torch.float32, device=q.device)
    else:  # the split kernel writes out itself; the partials are never touched
        part_out = part_lse = out
    k, v, write_loc = new_kv if new_kv is not None else (q, q, seq_lens)  # not read without WRITE_KV
    _decode_split_kernel[(bs, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse, out, k, v, write_loc,
        scale * 1.4426950408889634,  # scores in log2 units so the kernel can use exp2
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), *out.stride(),
        *k.stride(), *v.stride(),
        max_kv,
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=d, PAGE_SIZE=page_size,
        NUM_HEADS=hq, NUM_SPLITS=num_splits, MIN_SPLIT=_min_split(block_n), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), DOT_FP32=_dot_fp32(q.dtype), WRITE_KV=new_kv is not None,
        **options, **pdl_launch(q.device, pdl),
    )
    if num_splits == 1:
        return
    # The combine's sums over the splits follow the warp layout: this launch takes the split's warps,
    # as a one-split launch's in-kernel combine does (in float32 a 4-warp combine differed from a
    # 2-warp one on the H200).
    _decode_combine_kernel[(bs, hq)](
        part_out, part_lse, out, *out.stride(),
        NUM_HEADS=hq, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, _next_pow2(num_splits)), HEAD_DIM=d,
        **({"num_warps": options["num_warps"]} if "num_warps" in options else {}),
        **pdl_launch(q.device, pdl),
    )


# ----------------------------------------------------------------------------------------------
# b2. the decode forms that measured slower, and PDL

# A fused decode (the K/V write, the splits and the combine in one launch per layer, the last split of
# each (request, KV head) to arrive combining its GQA group through an arrival counter) was slower in
# every engine measurement on the H200: llama-1b 14 / 54 / 5 / 12 us per step more than the kernels it
# replaced at bs 1 / 8 / 32 / 64, llama-8b 51 / 205 / 58 / 35; and
# its CUDA-graph replay test failed in 2 of 4 runs on the H200 on the same inputs while the two-launch
# path passed every time. So the split kernel writes the new K/V rows
# and the combine stays a launch of its own: two kernels per layer instead of three (one with one
# split). The three-launch form (the KV write first) measured slower too: llama-8b TPOT 4.700 / 5.678
# ms at bs 1 / 32 against 4.630 / 5.553; it remains only as
# ``paged_decode`` without ``new_kv``, the tests' reference. Capping a one-request launch's splits
# measured slower as well (llama-8b bs=1 4.197 -> 4.389 ms at 2 splits).
#
# PDL (``KernelPolicy.decode_pdl``, on by default): the split and combine kernels launch with
# programmatic dependent launch, and every CUDA decode graph gets Inductor's ``triton.enable_pdl``
# (tscompile/piece_compiler.py). Each kernel waits (``gdc_wait``) before it reads or writes anything
# and lets the next kernel be scheduled (``gdc_launch_dependents``) right after: these launches are a
# few dozen programs, so the next kernel's programs can be resident and waiting while they run. On one
# H200, back-to-back processes: llama-8b TPOT 4.299 -> 4.182 ms at
# bs=1 and 5.627 -> 5.444 at bs=32; llama-1b 0.974 -> 0.948 (bs 1), 1.191 -> 1.181 (8),
# 1.398 -> 1.383 (32), 1.676 -> 1.673 (64); its GPU test bitwise equal to the plain launches.
# Kernel tables profiled under PDL count a waiting kernel's time too, so their sums exceed the step.
# ``KernelPolicy.prefill_pdl`` (off by default; on the H200 correct but no faster: llama-1b 1.40 vs
# 1.40 ms at 32 tokens, 1.58 vs 1.54 at 128) does the same for
# prefill steps: the dense extend kernel launches with PDL and the pieces of a split (prefill) graph
# get Inductor's PDL. cuBLAS and the other kernels between pieces launch without it, which is safe: a
# PDL kernel waits for the whole kernel before it, whatever launched that one.


@functools.lru_cache(maxsize=None)
def _pdl_device(device: torch.device) -> bool:
    """A CUDA device of Hopper or later (cached: a decode step run without its graph asks twice per layer,
    and ``torch.device.type`` alone costs about a microsecond)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_available(device: torch.device | str = "cuda") -> bool:
    """Whether a launch on ``device`` can use PDL: CUDA, Hopper or later, not the CPU interpreter
    (``gdc_wait`` has no interpreter form)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _pdl_device(device) and not _interpreting()


def pdl_launch(device: torch.device, pdl: bool) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr that turn PDL on (none where it is off
    or unavailable)."""
    return {"PDL": True, "launch_pdl": True} if pdl and pdl_available(device) else {}

@triton.jit
def _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, b, kvh,
                  stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                  stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``_kv_write_kernel`` for one (row, KV head): k[b, kvh], v[b, kvh] to slot write_loc[b]."""
    t = b.to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + kvh * stride_kh + d * stride_kd)
    v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + d * stride_vd)
    tl.store(k_cache_ptr + page * stride_kcp + off * stride_kco + kvh * stride_kch + d * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + page * stride_vcp + off * stride_vco + kvh * stride_vch + d * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty))


def _check_one_row_per_request(bs: int, k, v, write_loc) -> None:
    for name, rows in (("k", k.shape[0]), ("v", v.shape[0]), ("write_loc", write_loc.shape[0])):
        if rows != bs:
            raise ValueError(f"tscompile: a triton decode that writes the new K/V rows in its attention kernel "
                             f"needs one row per request: {name} has {rows} rows, q has {bs}")


# ----------------------------------------------------------------------------------------------
# c. extend / prefill: causal attention of ragged query blocks over the paged cache


# Extend launch configuration per head_dim: (tile rows = query positions x padded GQA group, keys per
# tile, warps, software-pipeline stages). Module-level so a launch sweep can try
# others.
EXTEND_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 4, 3), 256: (32, 32, 4, 2),
}


@triton.jit
def _extend_block(qo_indptr_ptr, seq_lens_ptr, tile, num_reqs, max_kv,
                  BLOCK_M: tl.constexpr, REQS_PAD: tl.constexpr):
    """Program ``tile``'s (request b, query block mb, q_start, q_len, prefix, padding_row), from
    qo_indptr alone: the requests' query blocks are numbered one after another, request b owning
    blocks [ends[b] - blocks[b], ends[b]), each request's from its last (longest causal) block down.
    A program past the last block gets q_len 0. prefix = the positions cached before this forward.

    padding_row: the first of the BLOCK_M token rows past ``qo_indptr[num_reqs]`` (a step padded to
    a token bucket) that this program owns, numbered from the first program past the last query
    block; negative for a program with a query block. The grid has cdiv(T, BLOCK_M) + B programs
    and the query blocks take at most (n + B * (BLOCK_M - 1)) / BLOCK_M of them (n live rows), so
    the spare ones number at least (T - n + B) / BLOCK_M: enough to own every padding row."""
    reqs = tl.arange(0, REQS_PAD)
    in_batch = reqs < num_reqs
    lens = (tl.load(qo_indptr_ptr + reqs + 1, mask=in_batch, other=0)
            - tl.load(qo_indptr_ptr + reqs, mask=in_batch, other=0))
    blocks = tl.where(in_batch, (lens + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(blocks, 0)
    b = tl.sum((ends <= tile).to(tl.int32), 0)
    has_work = b < num_reqs
    b = tl.minimum(b, num_reqs - 1)
    first = tl.sum(tl.where(reqs < b, blocks, 0), 0)
    mb = tl.sum(tl.where(reqs == b, blocks, 0), 0) - 1 - (tile - first)
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.where(has_work, tl.load(qo_indptr_ptr + b + 1) - q_start, 0)
    kv_len = tl.minimum(tl.load(seq_lens_ptr + b), max_kv)
    total = tl.sum(blocks, 0)
    live_rows = tl.load(qo_indptr_ptr + num_reqs)
    padding_row = tl.where(tile >= total, live_rows + (tile - total) * BLOCK_M, -1)
    return b, mb, q_start, q_len, kv_len - q_len, padding_row


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_table_ptr, seq_lens_ptr, qo_indptr_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcp, stride_kco, stride_kch, stride_kcd,
    stride_vcp, stride_vco, stride_vch, stride_vcd,
    stride_ptb, stride_ptp,
    max_kv, num_reqs, num_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, REQS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, ZERO_PADDING: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M) + B, Hkv): one program per query block of BLOCK_M positions of one
    request, for all GROUP query heads of KV head kvh, flattened into ROWS = BLOCK_M * GROUP_PAD tile
    rows (row r: query i = r // GROUP_PAD, head g = r % GROUP_PAD). The blocks of all requests are
    numbered one after another (request b has cdiv(q_len_b, BLOCK_M) of them, at most
    cdiv(T, BLOCK_M) + B - 1 in all), so the grid depends on static shapes only and hardly any
    program is idle; programs past the last block have an empty loop and store nothing. Within a
    request the last (longest causal) block comes first, so the long programs start early.

    Query i sits at position kv_len - q_len + i and attends causally to KV positions [0, that
    position], all read from the paged cache (the new rows were written first). Keys before the
    block's first query are seen by every row: those tiles run without masks; only the last tiles,
    along the diagonal, are masked.
    """
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    b, mb, q_start, q_len, prefix, padding_row = _extend_block(qo_indptr_ptr, seq_lens_ptr, tile, num_reqs,
                                                               max_kv, BLOCK_M, REQS_PAD)

    r = tl.arange(0, ROWS)
    q_lo = mb * BLOCK_M
    qi = q_lo + r // GROUP_PAD  # query index inside the request
    g = r % GROUP_PAD
    row_live = (qi < q_len) & (g < GROUP) & (qi >= 0)
    heads = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_live[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # k, p and v are cast to q's dtype below
    q_pos = prefix + qi  # [ROWS]

    # KV positions this block needs: up to its last live query's position (causal), inclusive;
    # every row sees [0, prefix + q_lo), of which the whole tiles need no mask.
    busy = (q_lo < q_len) & (q_lo >= 0)
    hi = tl.where(busy, prefix + tl.minimum(q_lo + BLOCK_M, q_len), 0)
    hi = tl.maximum(tl.minimum(hi, prefix + q_len), 0)  # prefix + q_len: the KV length
    bulk = tl.where(busy, (prefix + q_lo) // BLOCK_N * BLOCK_N, 0)

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for start in range(0, bulk, BLOCK_N):
        m_i, l_i, acc = _attend_paged_tile(
            q, q_pos, m_i, l_i, acc, start, hi, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False, MASKED=False, DOT_PRECISION=DOT_PRECISION)
    for start in range(bulk, hi, BLOCK_N):
        m_i, l_i, acc = _attend_paged_tile(
            q, q_pos, m_i, l_i, acc, start, hi, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=True, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    # A live row with no visible key (kv_len == 0) keeps l = 0 and gets zeros, like the oracle.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if ZERO_PADDING:  # a spare program attended nothing (o is 0): it zeroes its padding rows
        tok, row_live = _padding_rows(tok, row_live, padding_row, r, g, num_tokens, GROUP, GROUP_PAD)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=row_live[:, None])


@triton.jit
def _padding_rows(tok, row_live, padding_row, r, g, num_tokens, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """The tile rows' (token, live) for the final store: a spare program (``padding_row >= 0``,
    see ``_extend_block``) owns the padding rows [padding_row, padding_row + BLOCK_M) below
    ``num_tokens``, one tile row per (row, query head of this KV head), laid out as a query block's."""
    # scalar conditions enter only through scalar selects (the interpreter refuses a mask made by
    # and-ing a scalar with a vector); a program with a query block gets rows at or past num_tokens
    first = tl.where(padding_row >= 0, padding_row, num_tokens).to(tl.int64)
    pad_tok = first + r // GROUP_PAD
    pad_live = (pad_tok < num_tokens) & (g < GROUP)
    # a spare program has no live query row, a busy one no padding row: each row is one or neither
    return tl.where(row_live, tok, pad_tok), row_live | pad_live


def extend_config(head_dim: int, group_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M query positions, BLOCK_N keys, warps, stages) of the extend kernel."""
    rows, block_n, warps, stages = EXTEND_CONFIGS[head_dim]
    return max(rows // group_pad, 1), block_n, warps, stages


def paged_extend(q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale, zero_padding: bool = False) -> None:
    """Ragged causal attention. q, out: [T, Hq, D]; qo_indptr [B + 1]; page_table [B, max_pages].
    ``zero_padding``: rows past ``qo_indptr[-1]`` (a step padded to a token bucket) get zeros; else
    they are not written."""
    t, hq, d = q.shape
    b = page_table.shape[0]
    if t == 0 or b == 0:
        if zero_padding:
            out.zero_()  # no request: every row is padding
        return
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    group_pad = _next_pow2(group)
    block_m, block_n, warps, stages = extend_config(d, group_pad)
    # Every request's blocks fit in cdiv(T, BLOCK_M) + B programs (T bounds the sum of q_lens); the
    # grid depends on shapes only (no host read of qo_indptr).
    _extend_kernel[(triton.cdiv(t, block_m) + b, hkv)](
        q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr,
        scale * 1.4426950408889634,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(),
        page_table.shape[1] * page_size, b, t,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_M=block_m, ROWS=block_m * group_pad, BLOCK_N=block_n, REQS_PAD=max(_next_pow2(b), 2),
        DOT_PRECISION=_dot_precision(q.dtype), DOT_FP32=_dot_fp32(q.dtype), ZERO_PADDING=zero_padding,
        num_warps=warps, num_stages=stages,
    )


# ----------------------------------------------------------------------------------------------

# Head dims whose extend runs ``dense_extend`` (custom_ops/triton_extend.py: the new rows' K/V read
# from the dense k/v, only a cached prefix through the page table) instead of ``paged_extend``: those
# where a launch sweep measured it faster on the H200 in every workload it timed (1x2048,
# 32x512, 1x512 tokens; bf16): 1.03-1.48x at head_dim 64, 1.15-1.33x at 128. Others keep the paged one.
FAST_EXTEND_HEAD_DIMS: frozenset[int] = frozenset({64, 128})
_dense_extend = None  # set by register_dense_extend (triton_extend builds on this module's helpers)


_verify_attention = None  # set by register_verify_attention (triton_verify builds on this module's helpers)


def register_verify_attention(fn) -> None:
    """Called by custom_ops/triton_verify.py on import: the kernel of a decode with N > 1 rows per
    request (a speculative verify window)."""
    global _verify_attention
    _verify_attention = fn


def register_dense_extend(fn) -> None:
    """Called by custom_ops/triton_extend.py on import: the kernel FAST_EXTEND_HEAD_DIMS selects."""
    global _dense_extend
    _dense_extend = fn


def triton_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc,
                     scale, decode, *, decode_pdl: bool = True, prefill_pdl: bool = False,
                     fused_verify: bool = False) -> None:
    """``tscompile::attention`` with Triton kernels: write the new K/V rows, then attend (decode:
    split-KV + combine, the splits writing the new rows; otherwise ragged causal extend, which also
    zeroes the rows past ``qo_indptr[-1]``). Never syncs with the host. ``decode_pdl`` /
    ``prefill_pdl``: the decode / dense extend kernels launch with PDL (``attention_impl_name``).
    ``fused_verify``: a verify window's split kernel writes its new K/V rows, and its kernels take
    ``decode_pdl`` (``KernelPolicy.fused_verify_attention``).

    The dense extend kernel writes the new K/V rows itself (it reads them from ``k``/``v``, never
    from the cache), so that path launches one kernel per layer; the paged one reads them from the
    cache and needs ``write_kv`` first."""
    _check_inputs(q, k, v, k_cache, v_cache, out)
    if decode and q.shape[0] != page_table.shape[0]:  # a verify window: N > 1 rows per request
        if _verify_attention is None:
            raise RuntimeError("tscompile: a decode with several rows per request needs the verify kernel, but "
                               "tscompile.custom_ops.triton_verify was never imported")
        if fused_verify:
            _verify_attention(q, k_cache, v_cache, out, page_table, seq_lens, scale, new_kv=(k, v, write_loc),
                              pdl=decode_pdl)
        else:
            write_kv(k, v, k_cache, v_cache, write_loc)
            _verify_attention(q, k_cache, v_cache, out, page_table, seq_lens, scale)
    elif decode:
        paged_decode(q, k_cache, v_cache, out, page_table, seq_lens, scale, new_kv=(k, v, write_loc), pdl=decode_pdl)
    elif q.shape[2] in FAST_EXTEND_HEAD_DIMS:
        if _dense_extend is None:
            raise RuntimeError("tscompile: FAST_EXTEND_HEAD_DIMS selects the dense extend kernel, but "
                               "tscompile.custom_ops.triton_extend was never imported")
        _dense_extend(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale,
                      write_loc=write_loc, zero_padding=True, pdl=prefill_pdl)
    else:
        write_kv(k, v, k_cache, v_cache, write_loc)
        paged_extend(q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale, zero_padding=True)


def attention_impl_name(decode_pdl: bool = True, prefill_pdl: bool = False, fused_verify: bool = False) -> str:
    """The ``tscompile::attention`` impl that runs these kernels with PDL as asked (``KernelPolicy``'s
    ``decode_pdl`` / ``prefill_pdl``): "triton" for the defaults, else "triton/" and the fields that
    differ ("triton/decode_pdl=0,prefill_pdl=1"). The name is the op's argument, so a graph or an
    exported program records which launches it makes; every name is registered on import."""
    changed = [f"{name}={int(value)}" for name, value, default in
               (("decode_pdl", decode_pdl, True), ("prefill_pdl", prefill_pdl, False),
                ("fused_verify", fused_verify, False)) if value != default]
    return "triton" + ("/" + ",".join(changed) if changed else "")


# the extend kernels zero the padding rows themselves: run_attention adds no masked_fill_
for _decode_pdl, _prefill_pdl, _fused_verify in itertools.product((True, False), repeat=3):
    register_attention_impl(attention_impl_name(_decode_pdl, _prefill_pdl, _fused_verify),
                            functools.partial(triton_attention, decode_pdl=_decode_pdl, prefill_pdl=_prefill_pdl,
                                              fused_verify=_fused_verify),
                            zeroes_padding=True)
