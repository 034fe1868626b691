"""Recurrent-state layers: the gated delta rule and the short causal convolution before it, as
``tscompile::`` ops over per-request state slots.

A linear-attention layer (Gated DeltaNet, as in Qwen3-Next) keeps, per request, a fixed-size state
instead of a growing KV cache: the recurrent state ``S: [Hv, Dk, Dv]`` float32 and the last
``K - 1`` inputs of its depthwise causal convolution. Both live in pools indexed by a state slot,
the way KV lives in pages: ``state_slots[r]`` is request ``r``'s slot, slot 0 is the null slot that
padding rows read and write and no live request owns.

Rows are packed request-major like every other tscompile op: request ``r`` owns rows
``cu_seqlens[r] : cu_seqlens[r + 1]`` (a decode step is the case of one row per request).
``has_state[r]`` is False for a request's first chunk, which starts from a zero state and an
all-zero convolution window; later chunks and decode steps continue from the slot.

The recurrence, per value head, with ``q`` scaled by ``1 / sqrt(Dk)`` (and ``q``, ``k``
L2-normalized first when ``qk_l2norm``)::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
    o_t = S_t^T q_t

Two forms compute it. The recurrent form walks the tokens one by one (decode, and the Triton
kernel for every step, which keeps the state in registers). The chunked form (the torch reference
for prefill) solves a chunk of ``C`` tokens at once: inside a chunk with cumulative log-decay
``G_i``, the corrections ``delta`` satisfy a unit lower-triangular system
``(I + A) delta = beta * v - beta * exp(G) * K S_0`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j``
for ``j < i``; outputs and the state leaving the chunk follow by matrix products.

Speculative decoding runs a verify window of N rows per request through these ops, so the state
leaves the step having folded in rejected drafts too. Given ``checkpoints``, both ops also store
the state after each row of a request but its last (the slot keeps the last), and after acceptance
``commit_state_checkpoints`` writes back, in one launch over every layer, the checkpoint at each
request's accepted length: rejected rows leave no trace, and nothing is gathered on the host.

Kernels are chosen per call by ``impl`` ("torch", "triton", or "triton/pdl": the Triton kernels
launched with programmatic dependent launch where the device has it, as the decode graphs launch
their other kernels under ``KernelPolicy.decode_pdl``), as for attention; the name is the ops'
argument, so a graph records which launches it makes.
"""

from __future__ import annotations

import math

import torch

STATE_IMPLS = ("torch", "triton", "triton/pdl")
CONV_ACTIVATIONS = ("silu", "none")


def _check_impl(impl: str) -> None:
    if impl not in STATE_IMPLS:
        raise ValueError(f"tscompile: state kernel impl {impl!r} is unknown; known: {list(STATE_IMPLS)}")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, qk_l2norm: bool):
    """``q, k: [T, Hk, Dk]`` -> float32 ``[T, Hv, Dk]`` (each query/key head serves ``Hv / Hk``
    consecutive value heads), normalized and with ``q`` scaled by ``1 / sqrt(Dk)``."""
    q, k = q.float(), k.float()
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def recurrent_reference(q, k, v, g, beta, state):
    """The recurrent form over one request. ``q, k: [T, H, Dk]`` float32 (prepared), ``v: [T, H,
    Dv]``, ``g, beta: [T, H]``, ``state: [H, Dk, Dv]`` float32 -> (``out [T, H, Dv]``, new state)."""
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def chunked_reference(q, k, v, g, beta, state, chunk_size: int):
    """The chunked form over one request, same arguments and results as ``recurrent_reference``."""
    v, g, beta = v.float(), g.float(), beta.float()
    length = q.shape[0]
    out = torch.empty_like(v)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        # [H, C, D] per head
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[start:end].transpose(0, 1), beta[start:end].transpose(0, 1)
        cum = gc.cumsum(dim=-1)  # [H, C]: log of the decay from the chunk's start to each token
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_i - G_j) for j <= i; masked before exp so the upper triangle cannot overflow
        ratio = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, -math.inf).exp()
        kk = kc @ kc.transpose(-1, -2)
        system = (bc[:, :, None] * ratio * kk).tril(-1) + torch.eye(n, device=q.device)
        rhs_v = bc[:, :, None] * vc
        rhs_k = (bc * cum.exp())[:, :, None] * kc
        u = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
        delta = u - w @ state  # [H, C, Dv]
        out_c = (qc * cum.exp()[:, :, None]) @ state + ((qc @ kc.transpose(-1, -2)) * ratio) @ delta
        out[start:end] = out_c.transpose(0, 1)
        tail = (cum[:, -1:] - cum).exp()  # exp(G_C - G_j)
        state = cum[:, -1].exp()[:, None, None] * state + (kc * tail[:, :, None]).transpose(-1, -2) @ delta
    return out, state


def _gated_delta_torch(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
                       chunk_size, checkpoints):
    qp, kp = _prepare_qk(q, k, v.shape[1], qk_l2norm)
    bounds = cu_seqlens.tolist()
    slots = state_slots.tolist()
    fresh = (~has_state).tolist()
    for r, slot in enumerate(slots):
        lo, hi = bounds[r], bounds[r + 1]
        state = torch.zeros_like(state_pool[slot]) if fresh[r] else state_pool[slot]
        if checkpoints is not None:  # a verify window: row by row, keeping the state after each row
            for t in range(lo, hi):
                o, state = recurrent_reference(qp[t:t + 1], kp[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
                out[t:t + 1] = o.to(out.dtype)
                if t < hi - 1:
                    checkpoints[r, t - lo] = state
        elif hi - lo == 1:
            o, state = recurrent_reference(qp[lo:hi], kp[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
            out[lo:hi] = o.to(out.dtype)
        else:
            o, state = chunked_reference(qp[lo:hi], kp[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, chunk_size)
            out[lo:hi] = o.to(out.dtype)
        state_pool[slot] = state


@torch.library.custom_op("tscompile::gated_delta_rule", mutates_args=("state_pool", "out", "checkpoints"))
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_pool: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                     has_state: torch.Tensor, out: torch.Tensor, impl: str, qk_l2norm: bool,
                     chunk_size: int, checkpoints: torch.Tensor | None) -> None:
    """The gated delta rule over packed rows, continuing each request's state in its slot.

    q, k:        [T, Hk, Dk]   model dtype
    v, out:      [T, Hv, Dv]   model dtype (``Hv`` a multiple of ``Hk``)
    g, beta:     [T, Hv]       log-decay (<= 0) and write strength
    state_pool:  [S, Hv, Dk, Dv] float32, read and written at ``state_slots``
    state_slots: [R] int64; cu_seqlens: [R + 1] int32/int64; has_state: [R] bool
    ``chunk_size``: the chunk of multi-token requests. The torch form takes any size. Triton: 0 walks
    every request token by token; 16 runs the chunked kernel in a step with more rows than requests
    (a decode step, one row each, still walks: it is one token).
    checkpoints: [R, W, Hv, Dk, Dv] float32 or None: the state after row ``i`` of request ``r`` at
    ``[r, i]``, for every row but the request's last (``W`` >= its rows - 1); they always walk.
    """
    _check_impl(impl)
    _check_checkpoints("gated_delta_rule", checkpoints, state_slots, state_pool.shape[1:], q.shape[0])
    if impl != "torch":
        from tscompile.custom_ops.triton_gated_delta import gated_delta_chunked_triton, gated_delta_triton

        pdl = impl == "triton/pdl"
        # shapes only: the choice holds under capture
        if chunk_size and checkpoints is None and q.shape[0] > state_slots.shape[0]:
            gated_delta_chunked_triton(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out,
                                       qk_l2norm, chunk_size, pdl=pdl)
        else:
            gated_delta_triton(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
                               checkpoints, pdl=pdl)
    else:
        _gated_delta_torch(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, qk_l2norm,
                           chunk_size, checkpoints)


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, out, impl, qk_l2norm, chunk_size,
      checkpoints):
    return None


def _check_checkpoints(op: str, checkpoints: torch.Tensor | None, state_slots: torch.Tensor, per_slot,
                       num_rows: int) -> None:
    """A checkpoint buffer holds an entry per request of the step and per row but its last, each
    entry shaped as one slot. The rows per request live on the device, so the check is on the shapes
    a verify step has: ``num_rows`` spread evenly over the requests."""
    if checkpoints is None:
        return
    reqs = state_slots.shape[0]
    depth = -(-num_rows // max(reqs, 1)) - 1  # the deepest an even split of the rows needs
    if checkpoints.shape[0] < reqs or checkpoints.shape[1] < depth or checkpoints.shape[2:] != per_slot \
            or checkpoints.dtype != torch.float32:
        raise ValueError(f"tscompile: {op} checkpoints {tuple(checkpoints.shape)} {checkpoints.dtype} do not fit "
                         f"{reqs} requests of {num_rows} rows and state {tuple(per_slot)}; pass float32 "
                         f"[>= {reqs}, >= {depth}, {', '.join(map(str, per_slot))}]")


def _conv_torch(x, weight, bias, conv_pool, state_slots, cu_seqlens, has_state, out, activation, checkpoints):
    width = weight.shape[1]
    bounds = cu_seqlens.tolist()
    fresh = (~has_state).tolist()
    for r, slot in enumerate(state_slots.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        if hi == lo:  # an empty (padding) request: no rows to write, its window stays as it was
            continue
        window = torch.zeros_like(conv_pool[slot]) if fresh[r] else conv_pool[slot]  # [C, K-1]
        inputs = torch.cat([window.to(torch.float32), x[lo:hi].float().t()], dim=1)  # [C, K-1+L]
        y = torch.nn.functional.conv1d(inputs[None], weight.float()[:, None, :],
                                       None if bias is None else bias.float(), groups=weight.shape[0])[0]
        if activation == "silu":
            y = torch.nn.functional.silu(y)
        out[lo:hi] = y.t().to(out.dtype)
        conv_pool[slot] = inputs[:, inputs.shape[1] - (width - 1):].to(conv_pool.dtype)
        if checkpoints is not None:  # the window after row i: inputs i + 1 .. i + K - 1
            for i in range(hi - lo - 1):
                checkpoints[r, i] = inputs[:, i + 1: i + width]


@torch.library.custom_op("tscompile::causal_conv1d", mutates_args=("conv_pool", "out", "checkpoints"))
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                  state_slots: torch.Tensor, cu_seqlens: torch.Tensor, has_state: torch.Tensor, out: torch.Tensor,
                  impl: str, activation: str, checkpoints: torch.Tensor | None) -> None:
    """Depthwise causal convolution over packed rows, continuing each request's window in its slot.

    x, out:      [T, C]       model dtype
    weight:      [C, K]       (``nn.Conv1d(C, C, K, groups=C).weight[:, 0]``); bias: [C] or None
    conv_pool:   [S, C, K - 1] the last ``K - 1`` inputs per slot, oldest first
    state_slots, cu_seqlens, has_state: as for ``gated_delta_rule``
    ``activation``: "silu" or "none".
    checkpoints: [R, W, C, K - 1] float32 or None: the window after each row of a request but its
    last, as for ``gated_delta_rule``.
    """
    _check_impl(impl)
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"tscompile: causal_conv1d activation {activation!r} is unknown; "
                         f"known: {list(CONV_ACTIVATIONS)}")
    _check_checkpoints("causal_conv1d", checkpoints, state_slots, conv_pool.shape[1:], x.shape[0])
    if impl != "torch":
        from tscompile.custom_ops.triton_gated_delta import causal_conv1d_triton

        causal_conv1d_triton(x, weight, bias, conv_pool, state_slots, cu_seqlens, has_state, out, activation,
                             checkpoints, pdl=impl == "triton/pdl")
    else:
        _conv_torch(x, weight, bias, conv_pool, state_slots, cu_seqlens, has_state, out, activation, checkpoints)


@causal_conv1d.register_fake
def _(x, weight, bias, conv_pool, state_slots, cu_seqlens, has_state, out, impl, activation, checkpoints):
    return None


@torch.library.custom_op("tscompile::commit_state_checkpoints", mutates_args=("conv_pools", "ssm_pools"))
def commit_state_checkpoints(conv_pools: torch.Tensor, ssm_pools: torch.Tensor, conv_checkpoints: torch.Tensor,
                             ssm_checkpoints: torch.Tensor, state_slots: torch.Tensor, accepted: torch.Tensor,
                             drafts: int, impl: str) -> None:
    """After a verify step of ``drafts + 1`` rows per request: every layer's state of request ``r``
    goes back to its state after row ``accepted[r]`` of the window (the rows it keeps: the newest
    token and its accepted drafts).

    conv_pools:       [L, S, C, K - 1]      every state layer's pool, stacked
    ssm_pools:        [L, S, Hv, Dk, Dv]
    conv_checkpoints: [L, R', W, C, K - 1]  what the step's ops stored (``R'`` >= R, ``W`` >= drafts)
    ssm_checkpoints:  [L, R', W, Hv, Dk, Dv]
    state_slots: [R] int64; accepted: [R] int32/int64 in ``[0, drafts]``
    A request with ``accepted[r] == drafts`` kept its whole window: its slots already hold the state
    after the last row, and nothing is copied.
    """
    _check_impl(impl)
    if not 0 <= drafts <= ssm_checkpoints.shape[2] or state_slots.shape[0] > ssm_checkpoints.shape[1]:
        raise ValueError(f"tscompile: commit_state_checkpoints of {state_slots.shape[0]} requests x {drafts} drafts "
                         f"does not fit checkpoints of {ssm_checkpoints.shape[1]} requests x "
                         f"{ssm_checkpoints.shape[2]} rows; allocate the pool's checkpoints for the widest window")
    if impl != "torch":
        from tscompile.custom_ops.triton_gated_delta import commit_state_checkpoints_triton

        commit_state_checkpoints_triton(conv_pools, ssm_pools, conv_checkpoints, ssm_checkpoints, state_slots,
                                        accepted, drafts, pdl=impl == "triton/pdl")
        return
    for r, (slot, kept) in enumerate(zip(state_slots.tolist(), accepted.tolist())):
        if kept < drafts:
            conv_pools[:, slot] = conv_checkpoints[:, r, kept]
            ssm_pools[:, slot] = ssm_checkpoints[:, r, kept]


@commit_state_checkpoints.register_fake
def _(conv_pools, ssm_pools, conv_checkpoints, ssm_checkpoints, state_slots, accepted, drafts, impl):
    return None
