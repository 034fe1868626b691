"""Triton kernels of the recurrent-state ops (``gated_delta.py`` has the contract and the oracle).

Both kernels take one program per (request, head or channel block) and walk that request's rows
in order, so a decode step (one row per request) and a prefill chunk are the same launch, and both
read their bounds from device tensors: nothing is read back, so the launch can be captured in a
CUDA graph. The gated delta kernel keeps its ``[Dk, BLOCK_V]`` slice of the state in registers for
the whole walk and writes it back once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tscompile.custom_ops.triton_attention import pdl_launch


@triton.jit
def _program_state(state_ptr, slots_ptr, cu_ptr, has_state_ptr, stride_ss, stride_sh, stride_sk,
                   GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """What program (request, value head, value block) works on: its key head, key and value
    offsets and masks, the request's rows ``[lo, hi)`` and its ``[BLOCK_K, BLOCK_V]`` state slice in
    float32, with the slice's offsets and mask for the write-back. A request that starts fresh gets
    zeros, whatever its slot held. Every gated delta kernel starts here: with ``PDL`` (impl
    "triton/pdl") it first waits for the kernel before, whose output everything below may read."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    hv = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    lo = tl.load(cu_ptr + req).to(tl.int64)
    hi = tl.load(cu_ptr + req + 1).to(tl.int64)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    keep = tl.load(has_state_ptr + req) != 0
    state_offs = slot * stride_ss + hv * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    state_mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    return (hv, hv // GROUP, offs_k, offs_v, mask_k, mask_v, lo, hi, tl.where(keep, state, 0.0), state_offs,
            state_mask)


@triton.jit
def _row_qkv(q_ptr, k_ptr, v_ptr, t, hk, hv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
             offs_k, offs_v, mask_k, mask_v, scale, L2NORM: tl.constexpr):
    """Row ``t``'s query and key of key head ``hk`` (L2-normalized with ``L2NORM``, the query scaled)
    and its value columns ``offs_v`` of value head ``hv``, in float32."""
    q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    return q * scale, k, v


@triton.jit
def _delta_row(state, q, k, v, decay, beta):
    """One row of the recurrence on a ``[BLOCK_K, BLOCK_V]`` state slice: (the new state, the row's
    output columns), float32."""
    state = state * decay
    predicted = tl.sum(state * k[:, None], axis=0)
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, has_state_ptr, out_ptr,
                        ckpt_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                        stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, stride_cr, stride_ci,
                        scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, CHECKPOINT: tl.constexpr,
                        PDL: tl.constexpr = False):
    hv, hk, offs_k, offs_v, mask_k, mask_v, lo, hi, state, state_offs, state_mask = _program_state(
        state_ptr, slots_ptr, cu_ptr, has_state_ptr, stride_ss, stride_sh, stride_sk, GROUP, DK, DV, BLOCK_K, BLOCK_V,
        PDL)
    # entry [request, row] of the checkpoints is laid out as a slot
    ckpt_row0 = ckpt_ptr + tl.program_id(0).to(tl.int64) * stride_cr + hv * stride_sh + offs_k[:, None] * stride_sk \
        + offs_v[None, :]
    for t in range(lo, hi):
        q, k, v = _row_qkv(q_ptr, k_ptr, v_ptr, t, hk, hv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                           stride_vh, offs_k, offs_v, mask_k, mask_v, scale, L2NORM)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + hv).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + hv).to(tl.float32)
        state, o = _delta_row(state, q, k, v, decay, beta)
        tl.store(out_ptr + t * stride_ot + hv * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)
        if CHECKPOINT:
            if t < hi - 1:
                tl.store(ckpt_row0 + (t - lo) * stride_ci, state, mask=state_mask)
    # threads of several warps may hold the same state element, and the walk's reductions need not
    # cross warps: all of them must have read the slot before any writes it back
    tl.debug_barrier()
    tl.store(state_ptr + state_offs, state, mask=state_mask)


def _unit_stride(*tensors):
    """The tensors, each copied only where its last dimension is not unit-stride: the kernels take
    every other stride as an argument. A model hands q, k and v as views of one projection's output
    (split by columns), and a copy of each would be a kernel of its own in every layer's step."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _launch(kernel, q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm, block_k, block_v,
            pointers=(), strides=(), pdl: bool = False, **meta):
    """One program per (request, value head, ``block_v`` value columns) of either gated delta kernel;
    a kernel's own ``pointers`` go after ``out``, its own ``strides`` after the state pool's;
    ``pdl``: launched with programmatic dependent launch where the device has it."""
    num_reqs = state_slots.shape[0]
    if num_reqs == 0:
        return
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    q, k, v, g, beta = _unit_stride(q, k, v, g, beta)
    kernel[(num_reqs, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, *pointers,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), *strides, dk ** -0.5,
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=qk_l2norm, **meta,
        **pdl_launch(q.device, pdl))


def gated_delta_triton(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
                       checkpoints=None, pdl: bool = False):
    """The walk over every request's rows; with ``checkpoints`` ([R', W, Hv, Dk, Dv], each entry laid
    out as a slot) it also stores the state after each row but a request's last."""
    dk, dv = q.shape[2], v.shape[2]
    ckpt = state_pool if checkpoints is None else checkpoints  # any pointer: CHECKPOINT=False never reads it
    if checkpoints is not None and checkpoints.stride()[2:] != state_pool.stride()[1:]:
        raise ValueError(f"tscompile: gated delta checkpoints of strides {checkpoints.stride()} are not laid out as "
                         f"the state pool's slots {state_pool.stride()}; allocate them contiguous")
    _launch(_gated_delta_kernel, q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
            triton.next_power_of_2(dk), min(triton.next_power_of_2(dv), 64),
            pointers=(ckpt,), strides=(ckpt.stride(0), ckpt.stride(1)), pdl=pdl, CHECKPOINT=checkpoints is not None)


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, bias_ptr, pool_ptr, slots_ptr, cu_ptr, has_state_ptr, out_ptr, ckpt_ptr,
                          stride_xt, stride_ot, stride_ps, stride_pc, stride_cr, stride_ci, channels,
                          WIDTH: tl.constexpr, WINDOW_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SILU: tl.constexpr, BLOCK_C: tl.constexpr, CHECKPOINT: tl.constexpr,
                          PDL: tl.constexpr = False):
    if PDL:  # impl "triton/pdl": everything below may read the kernel before's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    cblock = tl.program_id(1)
    offs_c = cblock * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    lo = tl.load(cu_ptr + req).to(tl.int64)
    hi = tl.load(cu_ptr + req + 1).to(tl.int64)
    length = hi - lo
    slot = tl.load(slots_ptr + req).to(tl.int64)
    keep = tl.load(has_state_ptr + req) != 0
    window_base = pool_ptr + slot * stride_ps + offs_c * stride_pc  # window[c, j], j in [0, WIDTH - 1)
    entry = tl.arange(0, WINDOW_BLOCK)
    mask_entry = mask_c[:, None] & (entry[None, :] < WIDTH - 1)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for t in range(0, length):
        acc = bias
        for j in tl.static_range(WIDTH):
            # input j of the window ending at row t: position t - (WIDTH - 1) + j of this request;
            # before the request's first row it comes from the slot's window (zeros for a fresh one)
            pos = offs_c * 0 + (t - (WIDTH - 1) + j)  # a vector, so the masks below stay vectors
            from_x = tl.load(x_ptr + (lo + pos) * stride_xt + offs_c, mask=mask_c & (pos >= 0), other=0.0)
            from_window = tl.load(window_base + (WIDTH - 1 + pos), mask=mask_c & (pos < 0), other=0.0)
            from_window = tl.where(keep, from_window, 0.0)
            w = tl.load(w_ptr + offs_c * WIDTH + j, mask=mask_c, other=0.0).to(tl.float32)
            acc += w * (from_x.to(tl.float32) + from_window.to(tl.float32))
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (lo + t) * stride_ot + offs_c, acc.to(out_ptr.dtype.element_ty), mask=mask_c)
        if CHECKPOINT:  # the window after row t (but the last): entry j is position t - (WIDTH - 2) + j
            if t < length - 1:
                window = _window_after(x_ptr, window_base, lo, t + 1, keep, stride_xt, offs_c, entry, mask_entry,
                                       WIDTH)
                tl.store(ckpt_ptr + req.to(tl.int64) * stride_cr + t * stride_ci + offs_c[:, None] * (WIDTH - 1)
                         + entry[None, :], window, mask=mask_entry)
    # the new window: the last WIDTH - 1 inputs, entry j at position length - (WIDTH - 1) + j (from the
    # window itself while that is before the request's first row). A channel's element may live in
    # several threads of different warps, and nothing above synchronises them, so every read of the
    # old window has to land before the barrier and every write after it: otherwise a warp that ran
    # ahead rewrites an entry another warp has yet to read.
    value = _window_after(x_ptr, window_base, lo, length, keep, stride_xt, offs_c, entry, mask_entry, WIDTH)
    tl.debug_barrier()
    tl.store(window_base[:, None] + entry[None, :], value.to(pool_ptr.dtype.element_ty), mask=mask_entry)


@triton.jit
def _window_after(x_ptr, window_base, lo, rows, keep, stride_xt, offs_c, entry, mask_entry, WIDTH: tl.constexpr):
    """The convolution's window once the request's first ``rows`` rows are in: entry j is position
    ``rows - (WIDTH - 1) + j``, from the rows or, before the first, from the slot's old window (zeros
    for a fresh request). Float32 ``[BLOCK_C, WINDOW_BLOCK]``."""
    pos = rows - (WIDTH - 1) + entry[None, :] + offs_c[:, None] * 0
    from_x = tl.load(x_ptr + (lo + pos) * stride_xt + offs_c[:, None], mask=mask_entry & (pos >= 0), other=0.0)
    from_window = tl.load(window_base[:, None] + (WIDTH - 1 + pos), mask=mask_entry & (pos < 0), other=0.0)
    from_window = tl.where(keep, from_window, 0.0)
    return from_x.to(tl.float32) + from_window.to(tl.float32)


def causal_conv1d_triton(x, weight, bias, conv_pool, state_slots, cu_seqlens, has_state, out, activation,
                         checkpoints=None, pdl: bool = False):
    """One program per (request, channel block); with ``checkpoints`` ([R', W, C, K - 1], contiguous
    entries) it also stores the window after each row but a request's last."""
    num_reqs = state_slots.shape[0]
    if num_reqs == 0:
        return
    channels, width = weight.shape
    (x,), weight = _unit_stride(x), weight.contiguous()
    ckpt = conv_pool if checkpoints is None else checkpoints  # any pointer: CHECKPOINT=False never reads it
    if checkpoints is not None and checkpoints.stride()[2:] != (width - 1, 1):
        raise ValueError(f"tscompile: conv checkpoints of strides {checkpoints.stride()} are not contiguous per "
                         "entry; allocate them contiguous")
    block_c = min(triton.next_power_of_2(channels), 256)
    grid = (num_reqs, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_pool, state_slots, cu_seqlens, has_state, out, ckpt,
        x.stride(0), out.stride(0), conv_pool.stride(0), conv_pool.stride(1), ckpt.stride(0), ckpt.stride(1), channels,
        WIDTH=width, WINDOW_BLOCK=triton.next_power_of_2(max(width - 1, 1)), HAS_BIAS=bias is not None,
        SILU=activation == "silu", BLOCK_C=block_c, CHECKPOINT=checkpoints is not None, **pdl_launch(x.device, pdl))


@triton.jit
def _commit_kernel(conv_ptr, ssm_ptr, conv_ckpt_ptr, ssm_ckpt_ptr, slots_ptr, accepted_ptr,
                   stride_conv_l, stride_conv_s, stride_ssm_l, stride_ssm_s,
                   stride_cc_l, stride_cc_r, stride_cc_i, stride_sc_l, stride_sc_r, stride_sc_i,
                   conv_span, ssm_span, ssm_blocks, drafts, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (request, layer, block): a ``BLOCK`` of one layer's recurrent state (the first
    ``ssm_blocks`` blocks) or convolution window (the rest) of the request's slot, copied from the
    checkpoint at its accepted length."""
    if PDL:  # impl "triton/pdl": everything below may read the kernel before's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2)
    kept = tl.load(accepted_ptr + req).to(tl.int64)
    if kept < drafts:  # a request that kept its whole window already holds the state after the last row
        slot = tl.load(slots_ptr + req).to(tl.int64)
        row = req.to(tl.int64)
        if block < ssm_blocks:
            offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < ssm_span
            value = tl.load(ssm_ckpt_ptr + layer * stride_sc_l + row * stride_sc_r + kept * stride_sc_i + offs,
                            mask=mask)
            tl.store(ssm_ptr + layer * stride_ssm_l + slot * stride_ssm_s + offs, value, mask=mask)
        else:
            offs = (block - ssm_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < conv_span
            value = tl.load(conv_ckpt_ptr + layer * stride_cc_l + row * stride_cc_r + kept * stride_cc_i + offs,
                            mask=mask)
            tl.store(conv_ptr + layer * stride_conv_l + slot * stride_conv_s + offs, value, mask=mask)


COMMIT_BLOCK = 4096  # float32 elements a program copies


def commit_state_checkpoints_triton(conv_pools, ssm_pools, conv_checkpoints, ssm_checkpoints, state_slots, accepted,
                                    drafts, pdl: bool = False):
    """One launch over (request, layer, block of the slot's state): every entry a flat contiguous span."""
    num_reqs, num_layers = state_slots.shape[0], ssm_pools.shape[0]
    if num_reqs == 0 or num_layers == 0:
        return
    for t in (conv_pools, ssm_pools):
        if not t[0, 0].is_contiguous():
            raise ValueError(f"tscompile: state pools of strides {t.stride()} are not contiguous per slot")
    for t in (conv_checkpoints, ssm_checkpoints):
        if not t[0, 0, 0].is_contiguous():
            raise ValueError(f"tscompile: state checkpoints of strides {t.stride()} are not contiguous per entry")
    ssm_span, conv_span = ssm_pools[0, 0].numel(), conv_pools[0, 0].numel()
    ssm_blocks = triton.cdiv(ssm_span, COMMIT_BLOCK)
    grid = (num_reqs, num_layers, ssm_blocks + triton.cdiv(conv_span, COMMIT_BLOCK))
    _commit_kernel[grid](
        conv_pools, ssm_pools, conv_checkpoints, ssm_checkpoints, state_slots, accepted,
        conv_pools.stride(0), conv_pools.stride(1), ssm_pools.stride(0), ssm_pools.stride(1),
        conv_checkpoints.stride(0), conv_checkpoints.stride(1), conv_checkpoints.stride(2),
        ssm_checkpoints.stride(0), ssm_checkpoints.stride(1), ssm_checkpoints.stride(2),
        conv_span, ssm_span, ssm_blocks, drafts, BLOCK=COMMIT_BLOCK, **pdl_launch(ssm_pools.device, pdl))


@triton.jit
def _gated_delta_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, has_state_ptr,
                              out_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                              stride_bt, stride_ot, stride_oh,
                              stride_ss, stride_sh, stride_sk, scale, GROUP: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
                              LOG2_C: tl.constexpr, L2NORM: tl.constexpr, PDL: tl.constexpr = False):
    """The chunked form (``gated_delta.chunked_reference``): the program walks its request C rows at a
    time; inside a chunk every product is a matrix product (IEEE float32, no TF32). The chunk's unit lower-triangular system
    (I + A) is inverted as (I - A)(I + A^2)(I + A^4)...: A is strictly lower triangular, so A^C = 0
    and the product of LOG2_C factors is the exact inverse, in matrix products only. Rows past the
    request's end load as zero with beta = 0 and g = 0: they change neither the state nor the decay."""
    hv, hk, offs_k, offs_v, mask_k, mask_v, lo, hi, state, state_offs, state_mask = _program_state(
        state_ptr, slots_ptr, cu_ptr, has_state_ptr, stride_ss, stride_sh, stride_sk, GROUP, DK, DV, BLOCK_K, BLOCK_V,
        PDL)
    offs_c = tl.arange(0, C)
    lower = offs_c[:, None] >= offs_c[None, :]
    strict = offs_c[:, None] > offs_c[None, :]
    eye = (offs_c[:, None] == offs_c[None, :]).to(tl.float32)
    for start in range(lo, hi, C):
        rows = start + offs_c
        live = rows < hi
        qk_mask = live[:, None] & mask_k[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
            k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        q = q * scale
        v = tl.load(v_ptr + rows[:, None] * stride_vt + hv * stride_vh + offs_v[None, :],
                    mask=live[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows * stride_gt + hv, mask=live, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + hv, mask=live, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)  # log of the decay from the chunk's start to each row
        # exp(G_i - G_j) for j <= i, masked before exp so the upper triangle cannot overflow
        ratio = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(strict, beta[:, None] * ratio * kk, 0.0)
        inverse = eye - a
        power = a
        for _ in tl.static_range(LOG2_C - 1):
            power = tl.dot(power, power, input_precision="ieee")
            inverse = tl.dot(inverse, eye + power, input_precision="ieee")
        u = tl.dot(inverse, beta[:, None] * v, input_precision="ieee")
        w = tl.dot(inverse, (beta * tl.exp(cum))[:, None] * k, input_precision="ieee")
        delta = u - tl.dot(w, state, input_precision="ieee")
        qk = tl.where(lower, tl.dot(q, tl.trans(k), input_precision="ieee") * ratio, 0.0)
        out = tl.dot(q * tl.exp(cum)[:, None], state, input_precision="ieee") + \
            tl.dot(qk, delta, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * stride_ot + hv * stride_oh + offs_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & mask_v[None, :])
        total = tl.sum(g, axis=0)  # the whole chunk's log-decay (rows past the end add nothing)
        tail = tl.exp(total - cum)  # exp(G_C - G_j)
        state = tl.exp(total) * state + tl.dot(tl.trans(k * tail[:, None]), delta, input_precision="ieee")
    tl.debug_barrier()
    tl.store(state_ptr + state_offs, state, mask=state_mask)


CHUNK_ROWS = 16  # tl.dot's smallest tile, and the largest chunk whose inverse's product form holds up


def gated_delta_chunked_triton(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
                               chunk_size: int = CHUNK_ROWS, pdl: bool = False):
    """The chunked form over packed rows, ``CHUNK_ROWS`` rows a chunk. The product form of the
    inverse multiplies powers of A up to A^(C/2); where a chunk's keys all point one way and barely
    decay those powers hold binomial-sized entries that cancel: at 16 rows the outputs stayed within
    1e-4 of the walk in float32 there, at 32 rows they lost every digit."""
    if chunk_size != CHUNK_ROWS:
        raise ValueError(f"tscompile: the chunked gated delta kernel takes chunks of {CHUNK_ROWS} rows, got "
                         f"{chunk_size}; pass {CHUNK_ROWS}, or 0 to walk the tokens")
    dk, dv = q.shape[2], v.shape[2]
    _launch(_gated_delta_chunk_kernel, q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out,
            qk_l2norm, max(16, triton.next_power_of_2(dk)), max(16, min(triton.next_power_of_2(dv), 64)),
            pdl=pdl, C=chunk_size, LOG2_C=chunk_size.bit_length() - 1)
