"""Qwen3-Next (dense) as a native hybrid model: gated full-attention layers on the paged KV cache,
Gated DeltaNet linear-attention layers on per-request state slots (``kv_cache/state_pool.py``).

The decoder follows transformers' ``Qwen3NextForCausalLM`` with every MLP dense:

- every RMSNorm but the linear layers' gated one scales by ``1 + weight`` (the weights are stored
  as offsets from one);
- a full-attention layer's ``q_proj`` yields, per head, the query and a gate of the same width; the
  attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``; q and k get a per-head
  norm, and RoPE rotates only the first ``partial_rotary_factor`` of each head;
- a linear-attention layer is ``qwen3_next_linear.GatedDeltaNet``, reading its step's state slots,
  row offsets and fresh-state flags from the state backend through the forward context.

Rows are flat and request-major like every tscompile model; ``Transformer``'s four stages and RoPE
tables are reused (the tables cover the rotated part of a head only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from tscompile.custom_ops.gated_delta_fused import fused_head_fits
from tscompile.forward_context import get_forward_context
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.kv_cache.state_pool import StatePool, StateSpec
from tscompile.models.llama import MLP, ModelConfig, Transformer, apply_rope, rope_frequencies, rope_tables
from tscompile.models.parallel import TensorParallel, embedding, lm_head
from tscompile.models.qwen3_next_linear import GatedDeltaNet, in_proj_rows, state_spec

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    """A dense Qwen3-Next decoder. ``layer_types``: one of ``LAYER_TYPES`` per layer (empty: every
    fourth layer full attention, transformers' default); the ``linear_*`` fields shape the Gated
    DeltaNet layers; ``partial_rotary_factor``: the share of each head RoPE rotates."""

    qk_norm: bool = True
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25

    def __post_init__(self):
        super().__post_init__()
        types = tuple(self.layer_types) or tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.n_layers))
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.n_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"tscompile: Qwen3-Next layer_types {list(types)} must name one of {list(LAYER_TYPES)} "
                             f"for each of the {self.n_layers} layers")
        if "full_attention" not in types:
            raise ValueError(f"tscompile: Qwen3-Next layer_types {list(types)} has no full_attention layer; "
                             "tscompile needs at least one (the KV cache group the scheduler plans)")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"tscompile: partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                             f"{self.head_dim} rotates {self.rotary_dim} dims; it must be a positive even number")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"tscompile: linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if not self.qk_norm or self.qkv_bias or self.narrow_layer is not None:
            raise ValueError("tscompile: Qwen3-Next has q/k norms, no q/k/v biases and no narrowing; keep qk_norm=True, "
                             "qkv_bias=False and narrow_layer=None")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    # the names qwen3_next_linear reads (transformers' config names)
    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def rms_norm_eps(self) -> float:
        return self.norm_eps

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3NextConfig":
        return cls(**{**d, "layer_types": tuple(d.get("layer_types") or ())})


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: ``norm(x) * (1 + weight)`` in float32, then the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``2 * cos.shape[-1]`` dims of each head; the rest pass through."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate: ``wqkv`` = [q_proj (query and gate per head); k; v]."""

    def __init__(self, cfg: Qwen3NextConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.scale = cfg.head_dim ** -0.5
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        rows, d = x.shape[0], self.head_dim
        q_size, kv_size = self.n_heads * d, self.n_kv_heads * d
        qg, k, v = self.wqkv(x).split([2 * q_size, kv_size, kv_size], dim=-1)
        qg = qg.view(rows, self.n_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(rows, q_size)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(k.view(rows, self.n_kv_heads, d)), cos, sin)
        v = v.view(rows, self.n_kv_heads, d)
        out = torch.empty_like(q)
        ctx.attention.forward(self.layer_id, ctx.attention_mode, q, k, v, self.k_cache, self.v_cache, out, self.scale)
        return self.wo(out.view(rows, q_size) * torch.sigmoid(gate))


class HybridBlock(nn.Module):
    """One decoder layer: a token mixer (gated attention or Gated DeltaNet), then the dense MLP."""

    def __init__(self, cfg: Qwen3NextConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.linear = cfg.layer_types[layer_id] == "linear_attention"
        self.attention_norm = OffsetRMSNorm(cfg.dim, cfg.norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
            # bound by Qwen3NextTransformer.bind_state_pool: [S, C, K - 1] and [S, Hv, Dk, Dv] float32,
            # and with speculative decoding the verify steps' checkpoints, [R, W, ...] of the same
            for name in ("conv_state", "ssm_state", "conv_checkpoints", "ssm_checkpoints"):
                self.register_buffer(name, torch.empty(0), persistent=False)
        else:
            self.attention = GatedAttention(cfg, layer_id)
        self.ffn_norm = OffsetRMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MLP(cfg)

    def mix(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.linear:
            return self.attention(x, cos, sin)
        ctx = get_forward_context()
        meta = ctx.attention.state_metadata(ctx.attention_mode)
        checkpoints = (self.conv_checkpoints, self.ssm_checkpoints) if meta.checkpoints else None
        return self.linear_attn(x, self.conv_state, self.ssm_state, meta.state_slots, meta.cu_seqlens, meta.has_state,
                                checkpoints, decode=ctx.attention_mode.is_decode)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.mix(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3NextTransformer(Transformer):
    """The hybrid decoder behind ``Transformer``'s interface (stages, RoPE, cache groups), plus the
    state layers' ``state_spec`` and ``bind_state_pool``. One cache group holds the full-attention
    layers only; tensor parallelism is refused."""

    def __init__(self, cfg: Qwen3NextConfig, tp: TensorParallel | None = None):
        if tp is not None:
            raise ValueError(f"tscompile: tensor parallelism (size {tp.size}) is not supported for the hybrid "
                             "Qwen3-Next model; run it on one device (tensor_parallel_size=1)")
        nn.Module.__init__(self)
        self.tp = None
        self.full_config = self.config = cfg
        self.tok_embeddings = embedding(cfg, None)
        self.layers = nn.ModuleList(HybridBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = OffsetRMSNorm(cfg.dim, cfg.norm_eps)
        self.output = lm_head(cfg, None)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for name in ("inv_freq", "rope_cos", "rope_sin"):
            self.register_buffer(name, None, persistent=False)
        self.reset_rope(self.tok_embeddings.weight.device)

    def reset_rope(self, device: torch.device | str, positions: int | None = None) -> None:
        """``Transformer.reset_rope`` over the rotated dims of a head only."""
        limit = self.config.max_position
        positions = limit if positions is None else positions
        if not 1 <= positions <= limit:
            raise ValueError(f"tscompile: RoPE tables of {positions} positions; expected 1 to the model's "
                             f"max_position {limit}")
        rotary = replace(ModelConfig(), head_dim=self.config.rotary_dim, rope_theta=self.config.rope_theta,
                         rope_scaling=self.config.rope_scaling, n_heads=1, n_kv_heads=1)
        self.inv_freq = rope_frequencies(rotary).float().to(device)
        self.rope_cos, self.rope_sin = rope_tables(self.inv_freq, positions)

    def cache_groups(self) -> list[CacheGroupSpec]:
        cfg = self.config
        return [CacheGroupSpec("full", cfg.layers_of("full_attention"), cfg.n_kv_heads, cfg.head_dim)]

    def bind_kv_cache(self, pool: KVCachePool) -> None:
        for layer in self.layers:
            if not layer.linear:
                layer.attention.k_cache, layer.attention.v_cache = pool.layer_cache(layer.layer_id)

    def state_spec(self) -> StateSpec:
        return state_spec(self.config)

    def bind_state_pool(self, pool: StatePool, impl: str, triton_chunk: int = 0, fused_decode: bool = False,
                        value_blocks: int = 1) -> None:
        """Point every linear layer at its state in ``pool``; ``impl``: the state kernels ("torch",
        "triton" or "triton/pdl"); ``triton_chunk``: the Triton gated delta rule's chunk for multi-row steps (0: it
        walks the tokens); ``fused_decode``: decode steps run ``tscompile::gated_delta_fused`` (heads it
        can hold), its Triton kernel with ``value_blocks`` programs per value head."""
        for layer in self.layers:
            if layer.linear:
                layer.conv_state, layer.ssm_state = pool.layer_state(layer.layer_id)
                checkpoints = pool.layer_checkpoints(layer.layer_id)
                if checkpoints is not None:
                    layer.conv_checkpoints, layer.ssm_checkpoints = checkpoints
                layer.linear_attn.impl = impl
                layer.linear_attn.triton_chunk = triton_chunk
                # a head past the fused kernel's register tile keeps the three ops
                attn = layer.linear_attn
                attn.fused_decode = fused_decode and fused_head_fits(attn.dk, attn.dv)
                attn.value_blocks = min(value_blocks, 1 << (attn.dv - 1).bit_length())  # at most a column each

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Qwen3NextTransformer":
        """Seeded random weights: matrices ``N(0, std)``, norms at one (offset norms at zero), the
        decay parameters as transformers initialises them (``A`` uniform in [1, 16], ``dt_bias`` one)."""
        device = self.tok_embeddings.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        c = self.config  # in_proj is drawn in the checkpoint's row order: a seed gives one model in either layout
        rows = torch.tensor(in_proj_rows(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                         c.linear_value_head_dim), device=device)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                    p.fill_(1.0)
                elif name.endswith("norm.weight"):
                    p.zero_()
                elif name.endswith("A_log"):
                    p.copy_((1 + 15 * torch.rand(p.shape, generator=gen, device=p.device)).log())
                elif name.endswith("linear_attn.in_proj.weight"):
                    p[rows] = torch.randn(p.shape, generator=gen, device=p.device) * std
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)
        return self


# Random-weight presets (registered into ``llama.PRESETS`` by ``tscompile.models``). The 1B shape is
# Qwen3-Next's layout (three Gated DeltaNet layers to each gated-attention layer, 16 key / 32 value
# linear heads of 128, 16 query / 2 KV heads of 256 rotated a quarter) scaled to Llama-3.2-1B's
# width, depth and parameter count (1.23B with tied embeddings), with dense MLPs.
QWEN3_NEXT_PRESETS: dict[str, Qwen3NextConfig] = {
    "qwen3-next-tiny": Qwen3NextConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                                       intermediate_size=512, norm_eps=1e-6, linear_num_key_heads=2,
                                       linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
    "qwen3-next-1b": Qwen3NextConfig(vocab_size=151936, dim=2048, n_layers=16, n_heads=16, n_kv_heads=2, head_dim=256,
                                     intermediate_size=4096, rope_theta=10000000.0, norm_eps=1e-6,
                                     max_position=32768, tie_embeddings=True, linear_num_key_heads=16,
                                     linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
}
