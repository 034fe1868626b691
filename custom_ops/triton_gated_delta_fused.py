"""The Triton kernel of ``tscompile::gated_delta_fused`` (``gated_delta_fused.py`` has the contract).

It is ``triton_gated_delta.py``'s walk with the gates computed from their sources on entry to each
row and the gated RMSNorm applied to each row's output before it is stored. By default one program
per (request, value head) holds the head's whole ``[Dk, Dv]`` state slice, so a row's norm over
``Dv`` is a reduction inside the program. Every value the unfused layer rounds to the model dtype
(the write strength, the delta rule's output, the normed output before the weight) is rounded here
too.

Split (``value_blocks`` > 1): a head's value columns go to that many programs, so a batch of one
request launches more than one program per head. Each program stores its columns of each row's
output unnormed (rounded as above) and its share of the row's sum of squares; the last program of
the head to count in (an arrival counter per (request, head), as ``triton_gemv.py``'s ``_sum``
modes) norms and gates the head's whole rows from them. The sum of squares is added in another
order than the single program's, so the two agree to float32 rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

import torch

from tscompile.custom_ops.triton_attention import pdl_launch
from tscompile.custom_ops.triton_gated_delta import _delta_row, _program_state, _row_qkv, _unit_stride
from tscompile.custom_ops.triton_gemv import arrival_counters


@triton.jit
def _gated_norm(o, z_ptr, norm_w, offs_v, mask_v, sum_squares, eps, DV: tl.constexpr, dtype: tl.constexpr):
    """The gated RMSNorm of a row's output columns ``o`` (float32, already rounded to the model
    dtype) given the whole row's sum of squares: normed in float32, rounded, weighted by ``norm_w``
    (the same columns' norm weights, float32), rounded, gated by SiLU(z) of the same columns."""
    normed = (o * tl.math.rsqrt(sum_squares / DV + eps)).to(dtype).to(tl.float32)
    weighted = (norm_w * normed).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    return weighted * (z / (1.0 + tl.exp(-z)))


@triton.jit
def _gated_delta_fused_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, z_ptr, norm_w_ptr,
                              state_ptr, slots_ptr, cu_ptr, has_state_ptr, out_ptr, ckpt_ptr, squares_ptr,
                              count_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at,
                              stride_bt, stride_zt, stride_zh, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
                              stride_cr, stride_ci, scale, eps,
                              GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_V: tl.constexpr, BLOCK_DV: tl.constexpr, L2NORM: tl.constexpr,
                              CHECKPOINT: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    hv, hk, offs_k, offs_v, mask_k, mask_v, lo, hi, state, state_offs, state_mask = _program_state(
        state_ptr, slots_ptr, cu_ptr, has_state_ptr, stride_ss, stride_sh, stride_sk, GROUP, DK, DV, BLOCK_K, BLOCK_V,
        PDL)
    dtype = out_ptr.dtype.element_ty
    # per head: A = exp(A_log) in float32 (it may overflow 16 bits)
    decay_rate = tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    blocks = tl.num_programs(2)
    if not SPLIT:  # the norm's weight per column, once for every row this program norms
        norm_w = tl.load(norm_w_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    ckpt_row0 = ckpt_ptr + tl.program_id(0).to(tl.int64) * stride_cr + hv * stride_sh + offs_k[:, None] * stride_sk \
        + offs_v[None, :]
    for t in range(lo, hi):
        q, k, v = _row_qkv(q_ptr, k_ptr, v_ptr, t, hk, hv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                           stride_vh, offs_k, offs_v, mask_k, mask_v, scale, L2NORM)
        # the gates: softplus as torch's, log1p(exp(x)) (the input itself past 20). log(1 + e) loses e's
        # low bits to the rounding of 1 + e, and A (up to e^16) magnifies that in the decay, so log1p is
        # computed as log(u) * e / (u - 1), u = 1 + e rounded, which cancels that rounding (e where u is 1).
        # beta is stored in the model dtype.
        x = tl.load(a_ptr + t * stride_at + hv).to(tl.float32) + dt_bias
        ex = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + ex
        exact = u == 1.0
        log1p = tl.where(exact, ex, tl.log(u) * (ex / tl.where(exact, 1.0, u - 1.0)))
        softplus = tl.where(x > 20.0, x, log1p)
        decay = tl.exp(-decay_rate * softplus)
        b = tl.load(b_ptr + t * stride_bt + hv).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
        state, o = _delta_row(state, q, k, v, decay, beta)
        o = o.to(dtype).to(tl.float32)
        sum_squares = tl.sum(tl.where(mask_v, o * o, 0.0), axis=0)
        row_out = out_ptr + t * stride_ot + hv * stride_oh
        if SPLIT:  # this program's columns, unnormed, and their share of the row's sum of squares
            tl.store(row_out + offs_v, o.to(dtype), mask=mask_v)
            tl.store(squares_ptr + (t * tl.num_programs(1) + hv) * blocks + tl.program_id(2), sum_squares)
        else:
            gated = _gated_norm(o, z_ptr + t * stride_zt + hv * stride_zh, norm_w, offs_v, mask_v, sum_squares,
                                eps, DV, dtype)
            tl.store(row_out + offs_v, gated.to(dtype), mask=mask_v)
        if CHECKPOINT:
            if t < hi - 1:
                tl.store(ckpt_row0 + (t - lo) * stride_ci, state, mask=state_mask)
    # as in the unfused walk: every thread has read the slot before any writes it back
    tl.debug_barrier()
    tl.store(state_ptr + state_offs, state, mask=state_mask)
    if SPLIT:
        # count in once this program's rows and squares are stored (the barrier orders every thread's
        # stores before the acq_rel atomic, which publishes them); the head's last arrival norms its
        # rows, reading the others' stores through L2 (".cg"), and leaves the counter at zero
        tl.debug_barrier()
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + hv
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == blocks - 1:
            cols = tl.arange(0, BLOCK_DV)
            live = cols < DV
            shares = tl.arange(0, BLOCK_DV)
            head_norm_w = tl.load(norm_w_ptr + cols, mask=live, other=0.0).to(tl.float32)
            for t in range(lo, hi):
                row_out = out_ptr + t * stride_ot + hv * stride_oh
                o = tl.load(row_out + cols, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
                squares = tl.load(squares_ptr + (t * tl.num_programs(1) + hv) * blocks + shares,
                                  mask=shares < blocks, other=0.0, cache_modifier=".cg")
                gated = _gated_norm(o, z_ptr + t * stride_zt + hv * stride_zh, head_norm_w, cols, live,
                                    tl.sum(squares, axis=0), eps, DV, dtype)
                tl.store(row_out + cols, gated.to(dtype), mask=live)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def gated_delta_fused_triton(q, k, v, a, b, a_log, dt_bias, z, norm_weight, eps, state_pool, state_slots, cu_seqlens,
                             has_state, out, qk_l2norm, checkpoints=None, pdl: bool = False, value_blocks: int = 1):
    """One program per (request, value head, ``value_blocks`` share of the head's columns), each walking its
    request's rows. ``value_blocks`` > 1 falls back to whole heads where there are no arrival counters for
    the launch (more (request, head) pairs than counters, or a first call inside a CUDA-graph capture)."""
    num_reqs = state_slots.shape[0]
    if num_reqs == 0:
        return
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    ckpt = state_pool if checkpoints is None else checkpoints  # any pointer: CHECKPOINT=False never reads it
    if checkpoints is not None and checkpoints.stride()[2:] != state_pool.stride()[1:]:
        raise ValueError(f"tscompile: gated delta checkpoints of strides {checkpoints.stride()} are not laid out as "
                         f"the state pool's slots {state_pool.stride()}; allocate them contiguous")
    q, k, v, a, b, z = _unit_stride(q, k, v, a, b, z)
    block_k, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    counters = arrival_counters(q.device, num_reqs * hv, owner="gated_delta") if value_blocks > 1 else None
    blocks = value_blocks if counters is not None else 1
    squares = torch.empty((q.shape[0], hv, blocks), dtype=torch.float32, device=q.device) if blocks > 1 else ckpt
    block_v = block_dv // blocks
    # the [Dk, BLOCK_V] float32 slice lives in registers: 8 warps keep a 128 x 128 head at 64 per thread
    num_warps = 8 if block_k * block_v >= 128 * 128 else 4
    _gated_delta_fused_kernel[(num_reqs, hv, blocks)](
        q, k, v, a, b, a_log, dt_bias, z, norm_weight, state_pool, state_slots, cu_seqlens, has_state, out, ckpt,
        squares, state_slots if counters is None else counters,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), ckpt.stride(0), ckpt.stride(1),
        dk ** -0.5, eps, GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_DV=block_dv,
        L2NORM=qk_l2norm, CHECKPOINT=checkpoints is not None, SPLIT=blocks > 1, num_warps=num_warps,
        **pdl_launch(q.device, pdl))
