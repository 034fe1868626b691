"""The Triton kernel of ``tscompile::gated_delta_fused`` (``gated_delta_fused.py`` has the contract).

It is ``triton_gated_delta.py``'s walk with the gates computed from their sources on entry to each
row and the gated RMSNorm applied to each row's output before it is stored. One program per
(request, value head) holds the head's whole ``[Dk, Dv]`` state slice, so a row's norm over ``Dv``
is a reduction inside the program. Every value the unfused layer rounds to the model dtype (the
write strength, the delta rule's output, the normed output before the weight) is rounded here too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tscompile.custom_ops.triton_attention import pdl_launch
from tscompile.custom_ops.triton_gated_delta import _delta_row, _program_state, _row_qkv, _unit_stride


@triton.jit
def _gated_delta_fused_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, z_ptr, norm_w_ptr,
                              state_ptr, slots_ptr, cu_ptr, has_state_ptr, out_ptr, ckpt_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                              stride_zt, stride_zh, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
                              stride_cr, stride_ci, scale, eps,
                              GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, CHECKPOINT: tl.constexpr,
                              PDL: tl.constexpr = False):
    hv, hk, offs_k, offs_v, mask_k, mask_v, lo, hi, state, state_offs, state_mask = _program_state(
        state_ptr, slots_ptr, cu_ptr, has_state_ptr, stride_ss, stride_sh, stride_sk, GROUP, DK, DV, BLOCK_K, BLOCK_V,
        PDL)
    dtype = out_ptr.dtype.element_ty
    # per head: A = exp(A_log) in float32 (it may overflow 16 bits), the norm's weight per column
    decay_rate = tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
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
        # the gated RMSNorm of the row: normed in float32, rounded, weighted, gated by SiLU(z)
        mean_square = tl.sum(tl.where(mask_v, o * o, 0.0), axis=0) / DV
        normed = (o * tl.math.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
        weighted = (norm_w * normed).to(dtype).to(tl.float32)
        z = tl.load(z_ptr + t * stride_zt + hv * stride_zh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        gated = weighted * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + t * stride_ot + hv * stride_oh + offs_v, gated.to(dtype), mask=mask_v)
        if CHECKPOINT:
            if t < hi - 1:
                tl.store(ckpt_row0 + (t - lo) * stride_ci, state, mask=state_mask)
    # as in the unfused walk: every thread has read the slot before any writes it back
    tl.debug_barrier()
    tl.store(state_ptr + state_offs, state, mask=state_mask)


def gated_delta_fused_triton(q, k, v, a, b, a_log, dt_bias, z, norm_weight, eps, state_pool, state_slots, cu_seqlens,
                             has_state, out, qk_l2norm, checkpoints=None, pdl: bool = False):
    """One program per (request, value head), each walking its request's rows."""
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
    block_k, block_v = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    # the [Dk, Dv] float32 slice lives in registers: 8 warps keep a 128 x 128 head at 64 per thread
    num_warps = 8 if block_k * block_v >= 128 * 128 else 4
    _gated_delta_fused_kernel[(num_reqs, hv, 1)](
        q, k, v, a, b, a_log, dt_bias, z, norm_weight, state_pool, state_slots, cu_seqlens, has_state, out, ckpt,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), ckpt.stride(0), ckpt.stride(1),
        dk ** -0.5, eps, GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=qk_l2norm,
        CHECKPOINT=checkpoints is not None, num_warps=num_warps, **pdl_launch(q.device, pdl))
