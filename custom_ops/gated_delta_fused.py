"""The core of a Gated DeltaNet layer in one op: its gates from the input projection's raw columns,
the gated delta rule, and the gated RMSNorm of the result (``tscompile::gated_delta_fused``).

Unfused, a linear-attention layer of a decode step launches three kernels between its convolution
and its output projection: the pointwise gates (``beta = sigmoid(b)``, the log-decay ``g = -exp(A_log)
* softplus(a + dt_bias)``), the delta rule, and the norm of each head's output gated by ``SiLU(z)``.
At batch size 1 each of them is a few microseconds of launch and tail for almost no work, in every
linear layer. The Triton form here is one kernel: a program holds a whole value head (``Dv``
columns), so the head's norm needs nothing from another program.

The math is the model's (``models/qwen3_next_linear.py`` calls the same ``gates`` and
``gated_rms_norm``), and the Triton kernel rounds to the model dtype where the model's eager code
does (``beta``, the delta rule's output, the normed row before its weight). In float32 the fused
and unfused layers agree to the order of their reductions. In bfloat16 they need not agree bit for
bit: Inductor's kernels of the unfused layer may keep such an intermediate in float32 (it does not
emulate every cast by default), so a bf16 token can differ between the two policies where two
logits are that close.

A program holds a whole head's ``[Dk, Dv]`` float32 state in registers: heads up to
``MAX_HEAD_TILE`` elements (128 x 128, Qwen3-Next's) fit; larger ones run the three ops.

Arguments are ``gated_delta_rule``'s (``gated_delta.py``, which documents slots, rows and
checkpoints) with ``g``/``beta`` replaced by their sources and the norm's inputs added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tscompile.custom_ops.gated_delta import _check_checkpoints, _check_impl, _gated_delta_torch

TORCH_CHUNK = 64  # the torch form's chunk for multi-row requests (transformers' default)
MAX_HEAD_TILE = 128 * 128  # the largest (power-of-two padded) Dk x Dv a Triton program holds


def fused_head_fits(dk: int, dv: int) -> bool:
    """Whether a value head's ``[Dk, Dv]`` state fits one Triton program (its sizes padded to powers
    of two, as the kernel's tiles are)."""
    return (1 << (dk - 1).bit_length()) * (1 << (dv - 1).bit_length()) <= MAX_HEAD_TILE


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """``(g, beta)`` of a step from the projection's raw ``a``, ``b`` ``[T, Hv]``: the log-decay in
    float32 (``A = exp(A_log)`` may overflow 16 bits) and the write strength in the model dtype."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, then the SiLU gate of ``z`` (norm before gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(dtype)) * F.silu(z.float())).to(dtype)


@torch.library.custom_op("tscompile::gated_delta_fused", mutates_args=("state_pool", "out", "checkpoints"))
def gated_delta_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      a_log: torch.Tensor, dt_bias: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, state_pool: torch.Tensor, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                      has_state: torch.Tensor, out: torch.Tensor, impl: str, qk_l2norm: bool,
                      checkpoints: torch.Tensor | None, value_blocks: int = 1) -> None:
    """``out = gated_rms_norm(gated_delta_rule(q, k, v, *gates(a, b, a_log, dt_bias)), z)``.

    q, k:           [T, Hk, Dk]   model dtype
    v, z, out:      [T, Hv, Dv]   model dtype
    a, b:           [T, Hv]       the input projection's raw decay and write-strength columns
    a_log, dt_bias: [Hv]; norm_weight: [Dv]
    state_pool, state_slots, cu_seqlens, has_state, checkpoints: as for ``gated_delta_rule``.
    value_blocks:   Triton splits each value head's columns over this many programs (a power of two
                    up to the head's padded Dv; 1: a program per head); the torch form ignores it.
    Triton walks every request's rows (the decode and verify steps this op serves).
    """
    _check_impl(impl)
    _check_checkpoints("gated_delta_fused", checkpoints, state_slots, state_pool.shape[1:], q.shape[0])
    if impl != "torch":
        from tscompile.custom_ops.triton_gated_delta_fused import gated_delta_fused_triton

        if not fused_head_fits(q.shape[2], v.shape[2]):
            raise ValueError(f"tscompile: gated_delta_fused holds a value head's [{q.shape[2]}, {v.shape[2]}] state in "
                             f"registers, at most {MAX_HEAD_TILE} elements; run larger heads through the three ops "
                             "(kernels fused_gated_delta=False)")

        padded_dv = 1 << (v.shape[2] - 1).bit_length()
        if value_blocks < 1 or value_blocks & (value_blocks - 1) or value_blocks > padded_dv:
            raise ValueError(f"tscompile: gated_delta_fused value_blocks {value_blocks} must be a power of two from 1 "
                             f"to the head's padded value width {padded_dv}; pass 1 for a program per head")
        gated_delta_fused_triton(q, k, v, a, b, a_log, dt_bias, z, norm_weight, eps, state_pool, state_slots,
                                 cu_seqlens, has_state, out, qk_l2norm, checkpoints, pdl=impl == "triton/pdl",
                                 value_blocks=value_blocks)
        return
    g, beta = gates(a, b, a_log, dt_bias)
    core = torch.empty_like(v)
    _gated_delta_torch(q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_state, core, qk_l2norm,
                       TORCH_CHUNK, checkpoints)
    rows = int(cu_seqlens[-1])  # rows past the last request's (a padded bucket) are left unwritten
    out[:rows] = gated_rms_norm(core[:rows], z[:rows], norm_weight, eps)


@gated_delta_fused.register_fake
def _(q, k, v, a, b, a_log, dt_bias, z, norm_weight, eps, state_pool, state_slots, cu_seqlens, has_state, out, impl,
      qk_l2norm, checkpoints, value_blocks=1):
    return None
