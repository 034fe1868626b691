"""Qwen3-Next's linear-attention layer (Gated DeltaNet) on the tscompile state ops, and the checks
that keep the Qwen3-Next family dense.

The layer's parameters carry transformers' names (``conv1d``, ``dt_bias``, ``A_log``, ``norm``,
``out_proj``), so a checkpoint's ``linear_attn`` tensors load into it unchanged, except the two input
projections: one ``in_proj`` runs both (they read the same input, as ``wqkv`` does for attention),
its rows grouped by kind, ``[q | k | v | z | b | a]``, each kind's heads in order. The checkpoint
interleaves them per key head (``[q, k, v-group, z-group]`` and ``[b-group, a-group]``);
``in_proj_rows`` maps one layout to the other at load time, so that in a step the convolution's
input ``[q | k | v]`` is one column range of the projection's output, read in place, not gathered
by a copy. Rows are flat and request-major like every tscompile model; the per-request
state lives in a ``StatePool`` (``kv_cache/state_pool.py``) at the step's ``state_slots``.
"""

from __future__ import annotations

import torch
from torch import nn

from tscompile.custom_ops import gated_delta  # noqa: F401  (registers tscompile::gated_delta_rule)
from tscompile.custom_ops.gated_delta_fused import gated_rms_norm, gates
from tscompile.kv_cache.state_pool import StateSpec

CHUNK_SIZE = 64  # the torch reference's prefill chunk (transformers' default)
TRITON_CHUNK_SIZE = 16  # the chunked Triton kernel's (KernelPolicy.chunked_gated_delta)
# the fused kernel's programs per value head with KernelPolicy.split_gated_delta_heads: Qwen3-Next's 32 heads
# of a batch of one fill about one program per SM of an H100 or H200 (a program per head leaves 3 in 4 idle)
SPLIT_HEAD_BLOCKS = 4


def moe_layers(hf_config) -> list[int]:
    """The layers of a Qwen3-Next config that would carry a mixture of experts (transformers' rule:
    experts on, the layer not in ``mlp_only_layers``, and ``(i + 1) % decoder_sparse_step == 0``)."""
    experts = getattr(hf_config, "num_experts", 0) or 0
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [i for i in range(hf_config.num_hidden_layers) if experts > 0 and i not in dense and (i + 1) % step == 0]


def check_dense(hf_config) -> None:
    """Refuse a Qwen3-Next config with experts on any layer: only the dense family is native."""
    moe = moe_layers(hf_config)
    if moe:
        raise ValueError(f"tscompile: Qwen3-Next layers {moe} use a mixture of experts (num_experts="
                         f"{hf_config.num_experts}); only dense Qwen3-Next is supported: set mlp_only_layers to "
                         f"every layer (0..{hf_config.num_hidden_layers - 1}) or num_experts=0")


def state_spec(hf_config) -> StateSpec:
    """The state pool geometry of a Qwen3-Next config's linear-attention layers."""
    key_dim = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
    value_dim = hf_config.linear_num_value_heads * hf_config.linear_value_head_dim
    layers = tuple(i for i, t in enumerate(hf_config.layer_types) if t == "linear_attention")
    return StateSpec(layers, 2 * key_dim + value_dim, hf_config.linear_conv_kernel_dim,
                     hf_config.linear_num_value_heads, hf_config.linear_key_head_dim, hf_config.linear_value_head_dim)


def in_proj_rows(hk: int, hv: int, dk: int, dv: int) -> tuple[int, ...]:
    """The native ``in_proj`` row of each stored row, stored rows in checkpoint order:
    ``in_proj_qkvz`` (per key head: q, k, its ``hv / hk`` value heads' v, then their z), then
    ``in_proj_ba`` (per key head: its value heads' b, then their a)."""
    group = hv // hk
    key_dim, value_dim = hk * dk, hv * dv
    starts = {"q": 0, "k": key_dim, "v": 2 * key_dim, "z": 2 * key_dim + value_dim,
              "b": 2 * key_dim + 2 * value_dim, "a": 2 * key_dim + 2 * value_dim + hv}
    rows: list[int] = []
    for kinds, sizes in (("qkvz", (dk, dk, group * dv, group * dv)), ("ba", (group, group))):
        for h in range(hk):
            for kind, size in zip(kinds, sizes):
                rows.extend(range(starts[kind] + h * size, starts[kind] + (h + 1) * size))
    return tuple(rows)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the core output, then a SiLU gate from ``z`` (norm before gate, as the model)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, hf_config, impl: str = "torch"):
        super().__init__()
        c = hf_config
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.impl = impl
        self.triton_chunk = 0  # the Triton kernel's chunk: 0 walks the tokens (Qwen3NextTransformer.bind_state_pool)
        self.fused_decode = False  # decode steps through tscompile::gated_delta_fused (KernelPolicy.fused_gated_delta)
        self.value_blocks = 1  # the fused kernel's programs per value head (KernelPolicy.split_gated_delta_heads)
        width = c.linear_conv_kernel_dim
        # a plain Conv1d so the checkpoint's conv1d.weight [C, 1, K] loads as is
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, width, groups=self.conv_dim, bias=False,
                                padding=width - 1)
        self.in_proj = nn.Linear(c.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)  # [qkv|z|b|a]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, state_slots: torch.Tensor,
                cu_seqlens: torch.Tensor, has_state: torch.Tensor,
                checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None, decode: bool = False) -> torch.Tensor:
        """``x: [T, hidden]`` packed rows -> ``[T, hidden]``; reads and writes the slots in place.
        ``checkpoints``: a verify step's (conv, ssm) checkpoints, stored after each window row.
        ``decode``: a decode or verify step (a few rows per request), which ``fused_decode`` runs
        from the gates to the gated norm as one op."""
        conv_checkpoints, ssm_checkpoints = checkpoints if checkpoints is not None else (None, None)
        t = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        conv_out = torch.empty(t, self.conv_dim, dtype=x.dtype, device=x.device)
        torch.ops.tscompile.causal_conv1d(mixed, self.conv1d.weight[:, 0], None, conv_pool, state_slots, cu_seqlens,
                                          has_state, conv_out, self.impl, "silu", conv_checkpoints)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk), v.reshape(t, self.hv, self.dv)
        z = z.view(t, self.hv, self.dv)
        core = torch.empty(t, self.hv, self.dv, dtype=x.dtype, device=x.device)
        if decode and self.fused_decode:
            torch.ops.tscompile.gated_delta_fused(q, k, v, a, b, self.A_log, self.dt_bias, z, self.norm.weight,
                                                  self.norm.eps, ssm_pool, state_slots, cu_seqlens, has_state, core,
                                                  self.impl, True, ssm_checkpoints, self.value_blocks)
            return self.out_proj(core.reshape(t, self.value_dim))
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        torch.ops.tscompile.gated_delta_rule(q, k, v, g, beta, ssm_pool, state_slots, cu_seqlens, has_state, core,
                                             self.impl, True, CHUNK_SIZE if self.impl == "torch" else self.triton_chunk,
                                             ssm_checkpoints)
        return self.out_proj(self.norm(core, z).reshape(t, self.value_dim))
