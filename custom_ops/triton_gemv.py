"""Skinny matmul for decode: ``out[M, N] = x[M, K] @ w[N, K].T`` with M = 1..32 rows (32: the
32-token prefill step's projections, "dot" mode).

At decode batch sizes a projection reads its whole weight to produce a handful of rows, so the
time is the weight's bytes over the memory bandwidth; cuBLAS's kernels for the small llama
projections reach well under copy bandwidth. This kernel is built to stream ``w`` as nn.Linear
stores it ([N, K], K contiguous):

    - each program owns BLOCK_N output columns (rows of ``w``) and walks K in BLOCK_K chunks, so
      every load of ``w`` is BLOCK_N contiguous row segments (coalesced, 16-byte vectors);
    - the M rows of ``x`` for the chunk are loaded next to it and kept in registers; ``x`` is
      tiny and re-read by every program from L2, never from DRAM twice;
    - two ways to form the products, chosen by the config's mode:
        "fma": broadcast products on the CUDA cores, reduced along K per chunk; nothing is padded
               beyond the next power of two of M;
        "dot": ``tl.dot(w_tile, x_tile.T)`` with M padded to 16, i.e. the weight tile is the wide
               operand of the tensor-core product ("swap AB"), which keeps the accumulator at
               [BLOCK_N, 16] and lets Triton pipeline the weight tiles through shared memory;
        "acc": Inductor's GEMV reduction (what coordinate-descent tuning makes of a one-row matmul):
               a float32 product accumulator of the whole [BLOCK_N, BLOCK_K] chunk carried across
               the K loop and reduced once at the end, not per chunk; weights loaded with
               evict_first, x with evict_last. With 1-4 columns per program and K chunks of 512-4096
               this is the form the tuned static-cache baseline's llama-8b qkv and output
               projections read at 13.2-15.8 and 9.8-10.0 us per layer on the H200 (qkv with its
               RMSNorm fused in; cuBLAS 16.4 and 11.0 + 1.7 split-K reduce);
    - optional split-K: SPLIT_K programs per column block each cover one K range and write a
      float32 partial; a second small kernel sums the partials in a fixed order and casts. Plain
      stores instead of atomics keep the result deterministic and need no zeroed buffer.
      "dot_sum" is "dot" without that second kernel (likewise "fma_sum", "acc_sum"): each program
      counts itself in on a per-column-block counter after storing its partial, and the last to
      arrive sums the partials in split order (the second kernel's order, so the same bits) and
      resets the counter. At 8-32 rows a
      two-kernel split lost 2-3 us to split 1 per call on the H200, more than the extra programs
      gained. The counters are one buffer
      per device: calls on two streams at once must not both use it (the engine runs one stream).

Graph-safe: the grid and the split layout come from shapes only, nothing reads device memory on
the host, and the partial buffer is an ordinary allocation (from the graph's pool when captured).
Accumulation is float32 for every input dtype; float32 inputs use IEEE products.

Wired into the model by the decode GEMV pass (``KernelPolicy.decode_gemv``, passes/decode_gemv.py)
and the few-row swap of the decode batch graphs (``KernelPolicy.batch_gemv``, passes/batch_gemv.py),
each acting only on the GPUs its launch table was timed on (``gemv_tables_apply``).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tscompile.custom_ops.triton_attention import _interpreting, _next_pow2, pdl_launch

# Beyond this a step is a GEMM, not a skinny matmul: the weight tile's reuse across rows pays for a
# real GEMM's tiling. 17-32 rows run the "dot" mode with a [BLOCK_N, 32] accumulator: the 32-token
# prefill step (llama-8b's projections ran at 3.6 TB/s in cuBLAS there, H200).
MAX_ROWS = 32
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# "<mode>_sum": the same products, with the split's partials summed by the kernel's last program (below)
BASE_MODES = ("fma", "dot", "acc")
MODES = (*BASE_MODES, *(f"{m}_sum" for m in BASE_MODES))
DOT_MODES = ("dot", "dot_sum")

# Programs the automatic split-K aims for: about four per SM of an H200 (132 SMs), enough
# column-block x K-range programs in flight to saturate HBM when N alone gives too few.
TARGET_PROGRAMS = 528

# Tile per padded row count: (BLOCK_N, BLOCK_K, num_warps, num_stages, mode). The generic
# launch for shapes without a measured entry in the tables below.
# Few rows: CUDA-core products on narrow column blocks (many programs, long contiguous K
# segments). More rows: the products grow with M, so hand them to the tensor cores.
DEFAULT_TILES: dict[int, tuple[int, int, int, int, str]] = {
    1: (8, 512, 4, 2, "fma"), 2: (8, 512, 4, 2, "fma"), 4: (16, 256, 4, 2, "fma"),
    8: (64, 128, 4, 4, "dot"), 16: (64, 128, 4, 4, "dot"), 32: (64, 128, 4, 4, "dot"),
}


@triton.jit
def _acc_weights(w_rows, k, K, EVEN_K: tl.constexpr):
    """The "acc" mode's [1, BLOCK_N, BLOCK_K] weight chunk at columns ``k``; each weight byte is read
    once, so evict_first keeps it from displacing x (re-read by every program) in L2."""
    w_ptrs = w_rows[None, :, None] + k[None, None, :]
    if EVEN_K:
        return tl.load(w_ptrs, eviction_policy="evict_first")
    return tl.load(w_ptrs, mask=(k < K)[None, None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _acc_chunk(acc3, w, x_rows, k, K, EVEN_K: tl.constexpr):
    """One K chunk of the "acc" mode: x's [M_PAD, 1, BLOCK_K] chunk times the loaded weights, added
    elementwise into the float32 products ``acc3``."""
    x_ptrs = x_rows[:, None, None] + k[None, None, :]
    if EVEN_K:
        x = tl.load(x_ptrs, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptrs, mask=(k < K)[None, None, :], other=0.0, eviction_policy="evict_last")
    return acc3 + x.to(tl.float32) * w.to(tl.float32)


# M is not specialised: M == 1 would otherwise compile its own variant of every "dot" config
# (which pads M to 16 anyway) and double the sweep's compiles for no gain.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_os, stride_om, stride_on,
    fin_ptr, count_ptr, stride_fm, stride_fn,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr,
    PDL: tl.constexpr = False, LAST_SUMS: tl.constexpr = False,
):
    """Program (column block, K range): the float32 sum over its K range for its BLOCK_N columns
    and all M rows, stored to ``out`` at split ``program_id(1)`` (stride_os = 0 without split).

    LAST_SUMS (the "_sum" modes, split K): after storing its partial, each program counts itself in at
    ``count_ptr[pid_n]``; the last of the column block's splits to arrive sums the partials in split
    order (so the result does not depend on which one was last), stores the rounded sum to ``fin``
    and resets the counter to 0 for the next launch: no second kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    # Clamped indices keep the loads unmasked along N and M (tail columns/rows re-read the last
    # real one; their results are never stored), so the steady state is plain vector loads.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_wn  # N * K may pass 2**31
    x_rows = x_ptr + tl.minimum(m, M - 1) * stride_xm
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    elif ACC:  # products of every chunk summed elementwise, reduced across K once after the loop
        acc3 = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # what the kernel before wrote (x) is visible from here on
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        if USE_DOT:
            w_ptrs = w_rows[:, None] + k[None, :]  # [BLOCK_N, BLOCK_K]
            x_ptrs = x_rows[:, None] + k[None, :]  # [M_PAD, BLOCK_K]
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(k < K)[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=(k < K)[None, :], other=0.0)
            if DOT_FP32:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        elif ACC:
            acc3 = _acc_chunk(acc3, _acc_weights(w_rows, k, K, EVEN_K), x_rows, k, K, EVEN_K)
        else:
            # 3-D pointers pin the layout: a thread's weight elements meet every row of x it
            # needs inside the thread, so the M products per weight element need no shuffles.
            w_ptrs = w_rows[None, :, None] + k[None, None, :]  # [1, BLOCK_N, BLOCK_K]
            x_ptrs = x_rows[:, None, None] + k[None, None, :]  # [M_PAD, 1, BLOCK_K]
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=(k < K)[None, None, :], other=0.0)
                x = tl.load(x_ptrs, mask=(k < K)[None, None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # every load is issued: the next kernel may start
    if ACC:
        acc = tl.sum(acc3, axis=2)
    out_base = out_ptr + pid_k * stride_os
    if USE_DOT:
        live = (m < M)[None, :] & (n < N)[:, None]
        tl.store(out_base + m[None, :] * stride_om + n[:, None] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=live)
        if LAST_SUMS:  # out is the float32 partials here
            _sum_if_last(out_ptr, fin_ptr, count_ptr + pid_n, m[None, :] * stride_om + n[:, None] * stride_on,
                         m[None, :] * stride_fm + n[:, None] * stride_fn, live, stride_os)
    else:
        live = (m < M)[:, None] & (n < N)[None, :]
        tl.store(out_base + m[:, None] * stride_om + n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=live)
        if LAST_SUMS:
            _sum_if_last(out_ptr, fin_ptr, count_ptr + pid_n, m[:, None] * stride_om + n[None, :] * stride_on,
                         m[:, None] * stride_fm + n[None, :] * stride_fn, live, stride_os)


@triton.jit
def _sum_if_last(part_ptr, fin_ptr, counter, part_offs, fin_offs, live, stride_ps):
    """The "_sum" modes' tail of one program, over its tile's element offsets into one split's
    partials (``part_offs``) and into the output (``fin_offs``): count in after the partial is
    stored; the last arrival of the column block sums every split's partial in split order and
    resets the counter.

    Ordering: the barrier puts every thread's partial stores before the counting atomic, whose
    acq_rel at GPU scope publishes them (and, for the last arrival, makes the other programs'
    published partials visible); the partials are then read through L2 (".cg"), never a stale L1."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    splits = tl.num_programs(1)
    if arrived == splits - 1:
        total = tl.zeros(part_offs.shape, dtype=tl.float32)  # from zero as _sum_splits_kernel: the same bits
        for s in range(splits):
            total += tl.load(part_ptr + s * stride_ps + part_offs, mask=live, other=0.0, cache_modifier=".cg")
        tl.store(fin_ptr + fin_offs, total.to(fin_ptr.dtype.element_ty), mask=live)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, N, SPLITS, stride_ps, stride_pm, stride_om, stride_on, BLOCK: tl.constexpr,
):
    """out[row, cols] = sum over splits of the float32 partials, in split order (deterministic)."""
    row = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + n, mask=live, other=0.0)
    tl.store(out_ptr + row * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=live)


SUM_BLOCK = 1024

# The "_sum" modes: one arrival counter per column block, in one zeroed buffer per device made once and kept
# for the process (a CUDA graph captured with it holds its address; every launch leaves it zeroed). Another
# kernel that counts arrivals (the split gated delta kernel's heads) takes a buffer of its own (``owner``),
# so two such kernels in flight at once never share a counter.
ARRIVAL_SLOTS = 1 << 16
_ARRIVALS: dict[tuple[str, str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device, blocks: int, owner: str = "gemv") -> torch.Tensor | None:
    """The "_sum" modes' counters for ``blocks`` column blocks on ``device``, or None where the call must
    sum with the second kernel instead: more blocks than ARRIVAL_SLOTS, or a CUDA-graph capture
    before the buffer exists (made inside a capture, it would be zeroed only when the graph
    replays, not before an eager call)."""
    if blocks > ARRIVAL_SLOTS:
        return None
    key = (owner, device.type, device.index)
    counters = _ARRIVALS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _ARRIVALS[key] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return counters


def split_layout(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(programs along K, K elements per program) for a requested split: each range is a whole
    number of BLOCK_K chunks, and a split that would leave programs without a chunk is reduced,
    so every launched program has work and every partial gets written."""
    chunks = max(triton.cdiv(k, block_k), 1)
    per_split = triton.cdiv(chunks, min(split_k, chunks)) * block_k
    return max(triton.cdiv(k, per_split), 1), per_split


def auto_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """Split-K that brings the grid to about TARGET_PROGRAMS programs when N's column blocks
    alone fall short (the small projections); 1 when they already suffice."""
    blocks = triton.cdiv(n, block_n)
    if blocks >= TARGET_PROGRAMS:
        return 1
    return split_layout(k, block_k, triton.cdiv(TARGET_PROGRAMS, blocks))[0]


def _refuse_config(config, why: str):
    return ValueError(
        f"tscompile: gemv config {config!r} is not allowed ({why}); expected (BLOCK_N, BLOCK_K, SPLIT_K, "
        f"num_warps, num_stages[, mode]) with BLOCK_N, BLOCK_K powers of two, SPLIT_K >= 1, num_warps a "
        f"power of two <= 16, num_stages >= 1, mode one of {MODES} (default 'fma'); the dot modes need "
        f"BLOCK_N and BLOCK_K >= 16"
    )


def check_config(config) -> tuple[int, int, int, int, int, str]:
    """The config as a 6-tuple with its mode, or ValueError('tscompile: ...')."""
    if not isinstance(config, (tuple, list)) or len(config) not in (5, 6):
        raise _refuse_config(config, "needs 5 or 6 entries")
    block_n, block_k, split_k, warps, stages = config[:5]
    mode = config[5] if len(config) == 6 else "fma"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in config[:5]):
        raise _refuse_config(config, "the first five entries must be ints")
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731  (tl.arange sizes)
    if not (pow2(block_n) and pow2(block_k)):
        raise _refuse_config(config, "BLOCK_N and BLOCK_K must be powers of two")
    if split_k < 1 or stages < 1 or not (pow2(warps) and warps <= 16):
        raise _refuse_config(config, "bad SPLIT_K, num_warps or num_stages")
    if mode not in MODES:
        raise _refuse_config(config, f"unknown mode {mode!r}")
    if mode in DOT_MODES and min(block_n, block_k) < 16:  # tl.dot needs 16 per side
        raise _refuse_config(config, f"{mode!r} needs BLOCK_N and BLOCK_K >= 16")
    return block_n, block_k, split_k, warps, stages, mode


def default_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, str]:
    """DEFAULT_TILES for M's power-of-two bucket with the automatic split-K (the passes' calls run
    at their tables' launches instead)."""
    block_n, block_k, warps, stages, mode = DEFAULT_TILES[min(_next_pow2(max(m, 1)), MAX_ROWS)]
    return block_n, block_k, auto_split(n, k, block_n, block_k), warps, stages, mode


def _check_inputs(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, t, dims in (("x", x, "[M, K]"), ("w", w, "[N, K]")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"tscompile: gemv {name} must be a 2-D tensor {dims}; got {got}")
    (m, k), (n, kw) = x.shape, w.shape
    if kw != k:
        raise ValueError(f"tscompile: gemv needs x [M, K] and w [N, K] with the same K; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if m > MAX_ROWS:
        raise ValueError(f"tscompile: gemv supports M <= {MAX_ROWS} rows of x; got M = {m} (use a matmul)")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tscompile: gemv x dtype {x.dtype} is not supported; allowed: {SUPPORTED_DTYPES}")
    if w.dtype != x.dtype:
        raise ValueError(f"tscompile: gemv needs w with x's dtype {x.dtype}; got w {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"tscompile: gemv needs x and w on one device; got x on {x.device}, w on {w.device}")
    for name, t in (("x", x), ("w", w)):
        if k > 1 and t.stride(1) != 1:  # coalesced K loads are the whole point
            raise ValueError(f"tscompile: gemv {name} must be contiguous along K (stride 1 in the last dim); "
                             f"got strides {tuple(t.stride())}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype \
                or out.device != x.device:
            got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, torch.Tensor) else type(out)
            raise ValueError(f"tscompile: gemv out must be a {(m, n)} {x.dtype} tensor on {x.device}; got {got}")


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config=None, *,
         pdl: bool = False) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` into ``out [M, N]`` (allocated if None; any strides) and return it.

    M <= MAX_ROWS; x and w of one dtype among bf16/fp16/fp32, contiguous along K. ``config`` =
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, mode]) overrides ``default_config`` (for the
    sweep); SPLIT_K is reduced where K has fewer BLOCK_K chunks than splits. ``pdl``: launch with
    programmatic dependent launch where available (a graph whose Inductor kernels launch with it)."""
    _check_inputs(x, w, out)
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, warps, stages, mode = (
        default_config(m, n, k) if config is None else check_config(config))
    splits, per_split = split_layout(k, block_k, split_k)
    mode, sums_in_kernel = mode.removesuffix("_sum"), mode.endswith("_sum")
    use_dot = mode == "dot"
    counters = arrival_counters(x.device, triton.cdiv(n, block_n)) if sums_in_kernel and splits > 1 else None
    m_pad = max(_next_pow2(m), 16) if use_dot else _next_pow2(m)
    # bf16 tl.dot is wrong under the CPU interpreter: products in float32 there (GPU keeps 16-bit)
    dot_fp32 = use_dot and x.dtype == torch.bfloat16 and _interpreting()
    precision = "ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32"  # ignored for 16-bit
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    stride_os, stride_om, stride_on = (0, *out.stride()) if splits == 1 else target.stride()
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, w, target, m, n, k, per_split,
        x.stride(0), w.stride(0), stride_os, stride_om, stride_on,
        out, x if counters is None else counters, *(out.stride() if counters is not None else (0, 0)),
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        USE_DOT=use_dot, DOT_FP32=dot_fp32, DOT_PRECISION=precision, ACC=mode == "acc",
        LAST_SUMS=counters is not None, num_warps=warps, num_stages=stages, **pdl_launch(x.device, pdl),
    )
    if splits > 1 and counters is None:
        _sum_splits_kernel[(triton.cdiv(n, SUM_BLOCK), m)](
            target, out, n, splits, target.stride(0), target.stride(1), *out.stride(), BLOCK=SUM_BLOCK,
        )
    return out


# -- the decode graph's one-row projections -------------------------------------------------------
# With ``KernelPolicy.decode_gemv`` (on by default) the engine's bs=1 decode graph on CUDA runs the
# one-row matmuls whose weight shape has an entry below through ``tscompile::gemv``
# (passes/decode_gemv.py) instead of cuBLAS; other shapes stay cuBLAS. The launches are the picks of
# launch sweeps on the H200 (each beat cuBLAS's best by TABLE_MIN_SPEEDUP or more at M = 1), so the
# pass acts only on a GPU named in DECODE_GEMV_DEVICES. A model's shapes enter the table from a sweep
# of them (`tscompile bench --gemv-sweep --model M --gemv-rows 1`, then `scripts/apply_gemv_sweep.py`
# on its JSON). In the engine, one H200, back-to-back processes, bf16, bs=1 TPOT: llama-8b 4.542 ->
# 4.316 ms, llama-1b 1.100 -> 0.993 ms. The launches are for one row (the accumulator holds
# M x BLOCK_N x BLOCK_K products): the pass swaps one-row matmuls only. With coordinate-descent tuning
# on, Inductor turns one-row matmuls into its own reductions before the pass runs, so the pass then
# finds none.
#
# Not done, measured slower: moving the RMSNorm, the SiLU-mul and the residual add into the kernel (prologues and an
# epilogue): on the H200 bs=1 TPOT went llama-8b 4.317 -> 5.075 ms, llama-1b 0.996 -> 1.035; the norm prologue's extra loads cost the kernel more than
# the norm kernel it removed. Likewise loading the "acc" mode's first weight chunk before the PDL wait
# (llama-8b bs=1 4.325 -> 4.420 ms).
DECODE_GEMV_DEVICES = ("NVIDIA H200",)  # torch.cuda.get_device_name() of the GPUs the tables were timed on
DECODE_GEMV_CONFIGS: dict[tuple[int, int], tuple] = {  # (N, K): launch; us per call, this kernel / cuBLAS
    (3072, 2048): (1, 2048, 1, 8, 1, "acc"),     # llama-1b fused qkv: 6.0 / 6.4
    (2048, 2048): (1, 2048, 1, 8, 1, "acc"),     # llama-1b output: 4.7 / 6.1
    (2048, 8192): (1, 2048, 1, 8, 1, "acc"),     # llama-1b down: 10.0 / 13.5
    (6144, 4096): (1, 2048, 1, 8, 1, "acc"),     # llama-8b fused qkv: 13.7 / 15.5
    (4096, 4096): (1, 2048, 1, 8, 1, "acc"),     # llama-8b output: 10.0 / 13.4
    (4096, 14336): (1, 2048, 1, 8, 1, "acc"),    # llama-8b down: 29.1 / 31.3
    (128256, 4096): (1, 2048, 1, 8, 1, "acc"),   # llama-8b LM head: 233.9 / 243.2
}

# With coordinate-descent tuning on in the bs=1 decode graph (opt-in, the gpt-fast setting:
# ``static_inductor_options={"coordinate_descent_tuning": True}``), Inductor turns every one-row
# matmul into its own reduction before the pass runs, tunes it and fuses the RMSNorm before it (and
# the SiLU-mul before down) into it. The pass then finds those decompositions (passes/decode_gemv.py,
# ``swap_decomposed_matmuls``) and puts back, per weight shape, what beat Inductor's kernel: this
# kernel ("gemv", at its DECODE_GEMV_CONFIGS launch) or cuBLAS ("cublas"); shapes not listed keep
# Inductor's. The choice: the tuned static-cache baseline's kernel table (the same projections,
# Inductor-generated and tuned, norms fused) against tscompile-triton's, same machine, same call
# (H200, bs=1, us per layer).
# Inductor's kept: llama-8b qkv 13.8 with its norm vs 13.7 + 2.5 here, gate/up 55.2 with its norm vs
# cuBLAS 57.8 + 2.5; llama-1b qkv 6.0 with its norm vs 6.0 + 1.7, LM head 116 with its norm vs 123.
# In the engine on the H200 the tuning with this policy gained
# 0.8% at llama-8b bs=1 (4.197 -> 4.164 ms) and nothing on llama-1b, for 14 s more autotuning at
# start-up: the tuning stays opt-in.
DECODE_TUNED_MATMULS: dict[tuple[int, int], str] = {  # (N, K): "gemv" or "cublas"; us per call, that / Inductor's
    (4096, 4096): "gemv",     # llama-8b output: 10.0 / 10.5 (9.2 alone, 11.9 with the residual add)
    (4096, 14336): "gemv",    # llama-8b down: 29.1 + 1.5 SiLU-mul / 34.8 with it
    (128256, 4096): "gemv",   # llama-8b LM head: 234 / 245 with the final norm
    (2048, 2048): "gemv",     # llama-1b output: 4.7 / 5.1
    (2048, 8192): "gemv",     # llama-1b down: 10.0 + 1.2 SiLU-mul / 18.4 with it
    (16384, 2048): "cublas",  # llama-1b gate/up: 18.2 + 1.7 norm / 25.6 with it
}
TUNED_CHOICES = ("gemv", "cublas")


# -- the few-row projections of the decode batch graphs -------------------------------------------
# With ``KernelPolicy.batch_gemv`` (on by default) the engine's dynamic-batch decode graph (batch sizes
# 2..MAX_ROWS; the CUDA graph of each batch size makes the choice once, at capture) runs the matmuls
# whose weight shape is listed here through ``tscompile::skinny_mm`` (passes/batch_gemv.py), which
# takes this kernel at the listed launch when the step's row count M is listed with the shape, cuBLAS
# otherwise. Like the decode table, it applies only on a GPU named in DECODE_GEMV_DEVICES. On the
# H200, one machine, back-to-back processes, TPOT without -> with:
# llama-1b bs 8 / 32 1.186 -> 1.139 / 1.389 -> 1.355 ms, llama-8b 4.933 -> 4.757 / 5.552 -> 5.469;
# llama-1b 1.119 -> 1.068 / 1.261 -> 1.214 / 1.324 -> 1.302 at bs 2 / 16 / 24,
# llama-8b 5.174 -> 5.023 / 5.438 -> 5.380 at bs 16 / 24.
#
# The entries: launch sweeps on the H200 (bench/results/gemv-few-row-sweeps-h200/, a test checks the
# table equals their picks; `tscompile bench --gemv-sweep` runs one), each the best launch that beat
# cuBLAS by TABLE_MIN_SPEEDUP or more. At 8
# and 32 rows (the bench's decode batch sizes) every pick is "dot_sum": the two-kernel split
# lost to split 1, the in-kernel sum wins. At the ladder's other batch sizes 2, 4, 16 and 24:
# "dot_sum" again at 16 and 24, the
# CUDA-core "acc" forms at 2 rows, nothing at 4 (cuBLAS won every shape). Other row counts and shapes
# (qkv, gate/up, the LM head, llama-1b's o from 4 rows: cuBLAS was as fast or faster) stay cuBLAS.
#
# Not done: the same swap in the prefill pieces. Its kernels took less device time at 32 tokens, but
# the step's wall time came out within 1% either way on both models (not shown to pay).
BATCH_GEMV_CONFIGS: dict[tuple[int, int, int], tuple] = {  # us per call, this kernel / cuBLAS
    (2, 2048, 2048): (1, 2048, 8, 8, 1, "acc_sum"),    # llama-1b output: 5.9 / 6.0
    (2, 2048, 8192): (1, 2048, 1, 8, 1, "acc"),        # llama-1b down: 12.4 / 13.5
    (8, 2048, 8192): (64, 256, 4, 4, 3, "dot_sum"),    # llama-1b down: 11.9 / 13.6
    (16, 2048, 8192): (64, 128, 4, 4, 4, "dot_sum"),   # llama-1b down: 12.0 / 13.8
    (24, 2048, 8192): (64, 256, 4, 4, 3, "dot_sum"),   # llama-1b down: 12.9 / 14.2
    (32, 2048, 8192): (64, 128, 4, 4, 4, "dot_sum"),   # llama-1b down: 12.9 / 13.9
    (8, 4096, 4096): (64, 256, 2, 4, 3, "dot_sum"),    # llama-8b output: 12.1 / 13.3
    (16, 4096, 4096): (64, 128, 2, 4, 4, "dot_sum"),   # llama-8b output: 12.0 / 13.5
    (24, 4096, 4096): (64, 256, 2, 4, 3, "dot_sum"),   # llama-8b output: 12.8 / 13.6
    (32, 4096, 4096): (64, 128, 2, 4, 4, "dot_sum"),   # llama-8b output: 12.2 / 14.0
    (8, 4096, 14336): (64, 128, 4, 4, 4, "dot_sum"),   # llama-8b down: 31.7 / 32.4
    (16, 4096, 14336): (64, 128, 4, 4, 4, "dot_sum"),  # llama-8b down: 32.0 / 33.1
    (32, 4096, 14336): (64, 128, 2, 4, 4, "dot_sum"),  # llama-8b down: 32.9 / 33.6
}

TABLE_MIN_SPEEDUP = 1.02  # a smaller margin over cuBLAS is within run-to-run spread: not worth leaving it


def decode_table_from_sweep(result: dict, min_speedup: float = TABLE_MIN_SPEEDUP) -> dict[tuple[int, int], tuple]:
    """``DECODE_GEMV_CONFIGS`` from a launch sweep's JSON (``summary``: per shape, each launch's time): per shape, its best correct launch at
    M = 1 where that beat cuBLAS's best by ``min_speedup`` or more; other shapes stay cuBLAS."""
    table = {}
    for s in result["summary"].values():
        if s.get("best_m1") and s.get("speedup_m1") and s["speedup_m1"] >= min_speedup:
            table[(int(s["n"]), int(s["k"]))] = check_config(tuple(s["best_m1"]))
    return table


def batch_table_from_sweep(result: dict, min_speedup: float = TABLE_MIN_SPEEDUP) -> dict[tuple[int, int, int], tuple]:
    """``BATCH_GEMV_CONFIGS`` from a sweep's JSON: per shape and row count 1 < M <= MAX_ROWS
    (``best_by_m``), the best correct launch where it beat cuBLAS by ``min_speedup`` or more."""
    table = {}
    for s in result["summary"].values():
        for m, e in (s.get("best_by_m") or {}).items():
            if 1 < int(m) <= MAX_ROWS and e.get("best") and e.get("speedup") and e["speedup"] >= min_speedup:
                table[(int(m), int(s["n"]), int(s["k"]))] = check_config(tuple(e["best"]))
    return table


def gemv_tables_apply(device_name: str) -> bool:
    """Whether the GEMV launch tables hold for a GPU of this ``torch.cuda.get_device_name()``: they were
    timed on it. A launch tuned on one GPU can lose to cuBLAS on another, so no other GPU gets them."""
    return device_name in DECODE_GEMV_DEVICES


def _k_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with K contiguous, as ``gemv`` needs it (a compiled graph may hand over any layout)."""
    return x.contiguous() if x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1 else x


@torch.library.custom_op("tscompile::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` through ``gemv`` at ``DECODE_GEMV_CONFIGS``' launch for w's shape (the
    default one for a shape without an entry); ``pdl``: launched with PDL (the decode pass sets it
    where the graph's Inductor kernels have it)."""
    return gemv(_k_contiguous(x), w, config=DECODE_GEMV_CONFIGS.get(tuple(w.shape)), pdl=pdl)


@gemv_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def batch_gemv_weights() -> set[tuple[int, int]]:
    """The (N, K) weight shapes ``BATCH_GEMV_CONFIGS`` lists at some row count."""
    return {(n, k) for _, n, k in BATCH_GEMV_CONFIGS}


@torch.library.custom_op("tscompile::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T``: through ``gemv`` at ``BATCH_GEMV_CONFIGS``' launch when (M, N, K) is
    listed, else ``x @ w.T`` (cuBLAS on CUDA); M is known only now (the graph is compiled for every
    batch size). ``pdl``: the kernel launches with PDL (a graph whose Inductor kernels do)."""
    config = BATCH_GEMV_CONFIGS.get((x.shape[0], *w.shape))
    if config is None:
        return x @ w.T
    return gemv(_k_contiguous(x), w, config=config, pdl=pdl)


@skinny_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))
