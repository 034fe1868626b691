"""Extend (prefill) attention that reads this forward's own keys/values from the dense ``k``/``v``.

``_extend_kernel`` in ``triton_attention`` reads every key through the page table, one page-id
gather per key, after ``write_kv`` has scattered the new rows into the cache. For a fresh prompt
every key it reads is one of the new rows, which the op also receives as ``k``/``v [T, Hkv, D]``
(usually strided column slices of the fused qkv projection). Reading those directly gives plain
strided tile loads that Triton can pipeline; only the cached prefix of a request (positions below
``kv_len - q_len``) still goes through the page table.

Per query block of one request, one program (for all query heads of one KV head):
    1. the cached prefix [0, prefix) through the page table: unmasked tiles, one masked tail tile;
    2. the new rows j of the same request from the dense k/v: tiles wholly below the block's first
       query unmasked, the tiles on the diagonal masked (key j visible to query i iff j <= i), the
       tiles above the diagonal never visited.

Contract kept from ``_extend_kernel`` (so the two are interchangeable inside a captured graph):
    - grid from static shapes only: cdiv(T, BLOCK_M) + B query blocks per KV head, numbered
      request after request from ``qo_indptr`` on the device, a request's longest block first; no
      host read of any length; programs past the last block store nothing;
    - GQA rows packed per KV head: tile row r is query position r // GROUP_PAD, head r % GROUP_PAD,
      so each K/V tile is loaded once for the whole group, and a tile of ROWS rows spans only
      ROWS / GROUP_PAD positions, which keeps the masked diagonal work small;
    - query i of request b sits at position prefix + i, prefix = min(seq_lens[b], table capacity)
      - q_len; positions below 0 do not exist (a padded request with q_len 1 and seq_len 0 sees no
      key and gets zeros);
    - float32 accumulation; float32 inputs use IEEE products; a new key is rounded through the
      cache dtype before use, so the result equals reading it back from the cache.

Unlike ``_extend_kernel`` the grid is one-dimensional with the KV head varying fastest, so the
longest blocks of every KV head are scheduled first rather than those of head 0 only.

``triton_attention.FAST_EXTEND_HEAD_DIMS`` chooses, per head_dim, which extend kernel the op runs:
this one for the head dims measured faster on the H200 (64 and 128), the paged one elsewhere.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tscompile.custom_ops.triton_attention import (
    _attend_paged_tile, _dot_fp32, _dot_precision, _extend_block, _next_pow2, _padding_rows,
    check_supported, pdl_launch, register_dense_extend, write_kv,
)

LOG2_E = 1.4426950408889634

# Launch configuration per head_dim: (tile rows = query positions x padded GQA group, keys per tile,
# warps, software-pipeline stages). 64 and 128 are a launch sweep's picks on the H200 (bf16,
# page 16), the others are unmeasured proposals
# (FAST_EXTEND_HEAD_DIMS does not select the dense kernel for them). head_dim 128 (llama-8b shape):
# (64, 64, 4, 2) is the best or within 4% of it in every workload: 1x2048 100.8 us (341 TFLOP/s; old
# kernel 133.7), 32x512 322 us (old 369), 1x512 14.9 us (old 17.4).
EXTEND_DENSE_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 8, 3), 128: (64, 64, 4, 2), 256: (64, 64, 8, 2),
}
# head_dim 64 (llama-1b shape) has no one best: 128-row tiles with 4 warps run one long prompt at
# 54.4 us (316 TFLOP/s; old kernel 80.7) but lose to the old kernel on one short prompt (12.7 vs 11.4
# us), and 8 warps win with many prompts (32x512: 162 us, old 170). So the launch follows the step's
# shape (static: padded token count and request count), see extend_shape.
EXTEND_DENSE_SHAPE_CONFIGS: dict[tuple[int, str], tuple[int, int, int, int]] = {
    (64, "short"): (64, 64, 4, 2),   # 1x512: 10.7 us (old 11.4)
    (64, "long"): (128, 64, 4, 3),   # 1x2048: 54.4 us (old 80.7)
    # head_dim 128 (llama-8b shape), few long prompts: 128-row tiles with 8 warps. In the engine on
    # the H200, one 2048-token prompt: 125.3 us per layer (4009.6 per step) against 131.7 (4213.9)
    # for the default tile, 274 against 261 TFLOP/s; the step 48.40 against 49.25 ms.
    # At 512 tokens ("short") it was no faster (631 vs 622 us).
    (128, "long"): (128, 64, 8, 3),
}
SHORT_STEP_TOKENS = 1024  # at most this many (padded) tokens: too few tiles to fill the GPU with big ones
LONG_PROMPT_TOKENS = 1024  # tokens per request at least this: few long prompts


def extend_shape(tokens: int, requests: int) -> str:
    """"short", "long" (few long prompts) or "many" (many prompts) from the step's static sizes."""
    if tokens <= SHORT_STEP_TOKENS:
        return "short"
    return "long" if tokens >= LONG_PROMPT_TOKENS * max(requests, 1) else "many"


@triton.jit
def _attend_dense_tile(
    q, qi, m_i, l_i, acc, start, hi, k_base, v_base, k_cache_ptr, v_cache_ptr, d, scale_log2,
    stride_kt, stride_kd, stride_vt, stride_vd,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the tile rows over the request's new rows [start, start + BLOCK_N)
    read from the dense k/v (``k_base``/``v_base`` point at the request's first row and this KV
    head). MASKED=False: the caller guarantees every key of the tile exists and is visible to every
    row, so neither loads nor scores are masked. MASKED: keys at or past ``hi`` are not loaded and
    key j is visible to row r only if j <= qi[r] (causal)."""
    j = start + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + j[:, None] * stride_kt + d[None, :] * stride_kd
    v_ptrs = v_base + j[:, None] * stride_vt + d[None, :] * stride_vd
    if MASKED:
        live = j < hi
        k = tl.load(k_ptrs, mask=live[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    # Round through the cache dtype: the paged kernel and the oracle read these keys from the cache.
    k = k.to(k_cache_ptr.dtype.element_ty).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [ROWS, BLOCK_N], unscaled
    if MASKED:
        visible = live[None, :] & (j[None, :] <= qi[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        # scale_log2 > 0, so the scaled max is the max scaled; scale and shift fuse into one FMA
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    v = v.to(v_cache_ptr.dtype.element_ty).to(q.dtype)
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_dense_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, page_table_ptr, seq_lens_ptr, qo_indptr_ptr,
    write_loc_ptr, scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_kcp, stride_kco, stride_kch, stride_kcd,
    stride_vcp, stride_vco, stride_vch, stride_vcd,
    stride_ptb, stride_ptp,
    max_kv, num_reqs, num_tokens,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    REQS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    WRITE_KV: tl.constexpr, ZERO_PADDING: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid ((cdiv(T, BLOCK_M) + B) * Hkv,): program pid handles query block pid // Hkv of the
    concatenated requests for KV head pid % Hkv, or, past the last query block, BLOCK_M padding
    rows (``_extend_block``). See the module docstring. ``PDL`` (``KernelPolicy.prefill_pdl``): wait for the
    kernel before this one before reading anything, then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tile = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS

    # prefix < 0 only when seq_len < q_len (a padded request)
    b, mb, q_start, q_len, prefix, padding_row = _extend_block(qo_indptr_ptr, seq_lens_ptr, tile, num_reqs,
                                                               max_kv, BLOCK_M, REQS_PAD)

    q_lo = mb * BLOCK_M
    busy = (q_lo < q_len) & (q_lo >= 0)
    r = tl.arange(0, ROWS)
    qi = q_lo + r // GROUP_PAD  # query index inside the request
    g = r % GROUP_PAD
    row_live = (qi >= 0) & (qi < q_len) & (g < GROUP)  # all dead unless busy
    heads = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_live[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # keys, probabilities and values are cast to q's dtype

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)

    # 1. The cached prefix: every row sees all of it.
    cached = tl.where(busy, tl.maximum(prefix, 0), 0)
    cached_bulk = cached // BLOCK_N * BLOCK_N
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for start in range(0, cached_bulk, BLOCK_N):
        m_i, l_i, acc = _attend_paged_tile(
            q, 0, m_i, l_i, acc, start, cached, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False, MASKED=False, DOT_PRECISION=DOT_PRECISION)
    for start in range(cached_bulk, cached, BLOCK_N):
        m_i, l_i, acc = _attend_paged_tile(
            q, 0, m_i, l_i, acc, start, cached, pt_row, k_cache_ptr, v_cache_ptr, kvh, d, scale_log2, stride_ptp,
            stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    # 2. The new rows of this request, from the dense k/v. New row j sits at position prefix + j,
    # so rows below j_lo = -prefix would sit at negative positions: they do not exist.
    j_lo = tl.maximum(-prefix, 0)
    hi = tl.where(busy, tl.minimum(q_lo + BLOCK_M, q_len), 0)  # the block's last query, exclusive
    # tiles wholly below the block's first query q_lo: visible to every row
    bulk_end = tl.where(q_lo > j_lo, j_lo + (q_lo - j_lo) // BLOCK_N * BLOCK_N, j_lo)
    bulk_end = tl.minimum(bulk_end, hi)
    k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * stride_vh
    for start in range(j_lo, bulk_end, BLOCK_N):
        m_i, l_i, acc = _attend_dense_tile(
            q, qi, m_i, l_i, acc, start, hi, k_base, v_base, k_cache_ptr, v_cache_ptr, d, scale_log2,
            stride_kt, stride_kd, stride_vt, stride_vd,
            BLOCK_N=BLOCK_N, MASKED=False, DOT_PRECISION=DOT_PRECISION)
    for start in range(bulk_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_dense_tile(
            q, qi, m_i, l_i, acc, start, hi, k_base, v_base, k_cache_ptr, v_cache_ptr, d, scale_log2,
            stride_kt, stride_kd, stride_vt, stride_vd,
            BLOCK_N=BLOCK_N, MASKED=True, DOT_PRECISION=DOT_PRECISION)

    if WRITE_KV:
        # every token row's K/V for this KV head, each row by exactly one program: a query block's
        # rows by its program, the padding rows by the spare programs. No program reads a new row
        # from the cache (only the prefix cached before this forward), so the order does not matter.
        spare = padding_row >= 0
        first = tl.where(spare, padding_row, q_start + q_lo).to(tl.int64)
        end = tl.where(spare, num_tokens, q_start + q_len)  # a query block's rows end with its request
        row = first + tl.arange(0, BLOCK_M)
        live = row < end
        _write_kv_rows(row, live, kvh, d, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, write_loc_ptr,
                       stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                       stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
                       PAGE_SIZE)

    # A live row with no visible key (kv_len == 0) keeps l = 0 and gets zeros, like the oracle.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if ZERO_PADDING:  # a spare program attended nothing (o is 0): it zeroes its padding rows
        tok, row_live = _padding_rows(tok, row_live, padding_row, r, g, num_tokens, GROUP, GROUP_PAD)
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=row_live[:, None])


@triton.jit
def _write_kv_rows(row, live, kvh, d, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, write_loc_ptr,
                   stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                   stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
                   PAGE_SIZE: tl.constexpr):
    """KV head ``kvh`` of the token rows ``row`` (where ``live``) to their slots ``write_loc[row]``,
    cast to the cache dtype: what ``_kv_write_kernel`` does for those rows and that head."""
    slot = tl.load(write_loc_ptr + row, mask=live, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    m = live[:, None]
    k = tl.load(k_ptr + row[:, None] * stride_kt + kvh * stride_kh + d[None, :] * stride_kd, mask=m)
    v = tl.load(v_ptr + row[:, None] * stride_vt + kvh * stride_vh + d[None, :] * stride_vd, mask=m)
    kc = k_cache_ptr + page[:, None] * stride_kcp + off[:, None] * stride_kco + kvh * stride_kch + d[None, :] * stride_kcd
    vc = v_cache_ptr + page[:, None] * stride_vcp + off[:, None] * stride_vco + kvh * stride_vch + d[None, :] * stride_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def _check_config(config, head_dim: int) -> None:
    rows, block_n, warps, stages = config
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0  # noqa: E731  (tl.dot needs >= 16 per side)
    if not (pow2(rows) and pow2(block_n) and warps in (1, 2, 4, 8, 16) and stages >= 1):
        raise ValueError(
            f"tscompile: dense extend config {tuple(config)} for head_dim {head_dim} is not allowed; "
            "expected (rows, block_n, warps, stages) with rows and block_n powers of two >= 16, warps a "
            "power of two <= 16, stages >= 1"
        )


def extend_dense_config(head_dim: int, group_pad: int, config=None, four_byte: bool = False,
                        tokens: int = 0, requests: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M query positions, BLOCK_N keys, warps, stages); ``config`` overrides the tables, which
    pick by head_dim and the step's shape (``extend_shape(tokens, requests)``).

    The configurations are sized for 16-bit tiles. ``four_byte`` (float32 q or K/V): halve both
    tile sides and keep at most 2 stages, so the doubled bytes still fit in shared memory (a 128 x
    128 tile at head_dim 128 with 3 stages would need ~450 KB in float32)."""
    if config is None:
        config = EXTEND_DENSE_SHAPE_CONFIGS.get(
            (head_dim, extend_shape(tokens, requests)), EXTEND_DENSE_CONFIGS[head_dim])
    config = tuple(config)
    _check_config(config, head_dim)
    rows, block_n, warps, stages = config
    if four_byte:
        rows, block_n, stages = max(rows // 2, 16), max(block_n // 2, 16), min(stages, 2)
    return max(rows // group_pad, 1), block_n, warps, stages


def dense_extend(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale, config=None, *,
                 write_loc=None, zero_padding: bool = False, pdl: bool = False) -> None:
    """Ragged causal attention of ``q [T, Hq, D]`` into ``out``: each request's cached prefix from
    the paged cache, its new rows from ``k``/``v [T, Hkv, D]`` (any strides). The new rows need not
    be in the cache yet. ``config`` = (rows, block_n, warps, stages) overrides
    ``EXTEND_DENSE_CONFIGS`` (for the sweep).

    ``write_loc [T] int64``: also write every new row (padding rows included) to its cache slot, as
    ``triton_attention.write_kv`` would, inside this one launch. ``zero_padding``: rows past
    ``qo_indptr[-1]`` get zeros; without it they are not written. ``pdl``: launch with programmatic
    dependent launch where the device has it (``KernelPolicy.prefill_pdl``)."""
    t, hq, d = q.shape
    b = page_table.shape[0]
    if t == 0 or b == 0:
        if t and write_loc is not None:
            write_kv(k, v, k_cache, v_cache, write_loc)
        if zero_padding:
            out.zero_()  # no request: every row is padding
        return
    check_supported(d, k_cache.dtype, "dense extend")
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv or k.shape[1] != hkv or v.shape[1] != hkv:
        raise ValueError(
            f"tscompile: dense extend needs Hq % Hkv == 0 and k, v with Hkv heads; got q heads {hq}, cache "
            f"heads {hkv}, k heads {k.shape[1]}, v heads {v.shape[1]}"
        )
    group = hq // hkv
    group_pad = _next_pow2(group)
    four_byte = max(t.element_size() for t in (q, k, v, k_cache, v_cache)) >= 4
    block_m, block_n, warps, stages = extend_dense_config(d, group_pad, config, four_byte, tokens=t, requests=b)
    # Every request's blocks fit in cdiv(T, BLOCK_M) + B blocks (T bounds the sum of q_lens).
    grid = ((triton.cdiv(t, block_m) + b) * hkv,)
    _extend_dense_kernel[grid](
        q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr,
        write_loc if write_loc is not None else qo_indptr,  # not read without WRITE_KV
        scale * LOG2_E,  # scores in log2 units so the kernel can use exp2
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        *page_table.stride(),
        page_table.shape[1] * page_size, b, t,
        NUM_KV_HEADS=hkv, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_M=block_m, ROWS=block_m * group_pad, BLOCK_N=block_n, REQS_PAD=max(_next_pow2(b), 2),
        DOT_PRECISION=_dot_precision(q.dtype), DOT_FP32=_dot_fp32(q.dtype),
        WRITE_KV=write_loc is not None, ZERO_PADDING=zero_padding,
        num_warps=warps, num_stages=stages, **pdl_launch(q.device, pdl),
    )


register_dense_extend(dense_extend)
