"""A Llama-family decoder written against the tscompile ops, one readable file (gpt-fast style).

Inputs are flat rows: ``input_ids: [T] int64``, ``positions: [T] int64`` (request-major, the row
plan lives in the forward context). The KV cache is per-layer module buffers bound from a pool:
``k_cache, v_cache: [num_pages, page_size, n_kv_heads, head_dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.forward_context import get_forward_context
from tscompile.models.parallel import ShardLayout, TensorParallel, column_linear, embedding, lm_head, row_linear


# RoPE scaling types and the parameters each needs ("default" is stored as rope_scaling=None)
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "high_freq_factor", "low_freq_factor", "original_max_position"),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position: int = 4096
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # sorted (key, value) pairs, hashable: ("rope_type", "linear" | "llama3") plus that type's
    # ROPE_SCALING_KEYS; a dict is accepted and normalised. A missing rope_type means llama3 (the only
    # type configs carried before the type was stored).
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    # CED-style narrowing (None: a plain decoder): layers [narrow_layer, n_layers) run on kept rows
    narrow_layer: int | None = None
    narrow_window: int = 4
    # None: dim // n_heads. Qwen3 sets it explicitly; q and o projections then use n_heads * head_dim
    head_dim: int | None = None
    # per-head RMSNorm over head_dim on q and k before RoPE (Qwen3)
    qk_norm: bool = False

    def __post_init__(self):
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"tscompile: dim {self.dim} is not divisible by heads {self.n_heads}; "
                                 "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"tscompile: head_dim {self.head_dim} must be positive and even (RoPE rotates halves)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"tscompile: heads {self.n_heads} is not a multiple of kv heads {self.n_kv_heads}")
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        if self.narrow_layer is not None and not 0 < self.narrow_layer < self.n_layers:
            raise ValueError(f"tscompile: narrow_layer {self.narrow_layer} must be inside (0, {self.n_layers})")

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of ``to_dict``; also reads dicts written before head_dim and qk_norm were fields."""
        return cls(**d)


def _normalise_rope_scaling(scaling) -> tuple[tuple[str, float | str], ...] | None:
    if not scaling:
        return None
    s = dict(scaling)
    rope_type = s.pop("rope_type", "llama3")
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(f"tscompile: rope scaling type {rope_type!r} is not supported; supported: "
                         f"default, {', '.join(ROPE_SCALING_KEYS)}")
    want = set(ROPE_SCALING_KEYS[rope_type])
    if set(s) != want:
        raise ValueError(f"tscompile: {rope_type} rope scaling takes exactly {sorted(want)}, got {sorted(s)}")
    return tuple(sorted([(k, float(v)) for k, v in s.items()] + [("rope_type", rope_type)]))


_LLAMA3_SCALING = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                   ("original_max_position", 8192.0), ("rope_type", "llama3"))

PRESETS: dict[str, ModelConfig] = {
    "llama-tiny": ModelConfig(),
    "llama-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            intermediate_size=8192, rope_theta=500000.0, max_position=131072,
                            tie_embeddings=True, rope_scaling=_LLAMA3_SCALING),
    "llama-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            intermediate_size=14336, rope_theta=500000.0, max_position=8192),
    "narrow-tiny": ModelConfig(n_layers=4, narrow_layer=2, narrow_window=4),
}


def _linear_scaling(inv: torch.Tensor, s: dict) -> torch.Tensor:
    return inv / s["factor"]  # positions / factor, folded into the frequencies


def _llama3_scaling(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Long wavelengths divided by factor, short ones kept, the band between interpolated."""
    factor, low, high, orig = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position"]
    wavelen = 2 * math.pi / inv
    smooth = ((orig / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


_ROPE_SCALERS = {"linear": _linear_scaling, "llama3": _llama3_scaling}  # keys: ROPE_SCALING_KEYS


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float64, scaled by ``cfg.rope_scaling``'s type."""
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)
    return _ROPE_SCALERS[s["rope_type"]](inv, s)


def rope_tables(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency for every position below ``positions``,
    ``[positions, head_dim // 2]`` float32, computed with the ops a forward once ran per step (a
    float32 product, then cos / sin). A step gathers its rows instead. Evaluated per step, cos and
    sin were inlined by Inductor into every layer's query and key RoPE kernels, for every head, and
    those kernels' speed varied from one compile to the next with the launch configuration Inductor's
    one-off benchmark chose (on the H200: 1.9 or 4.0-4.4 us per layer; the tuned static-cache
    baseline's RoPE kernel 394 us per llama-8b bs=32 step in one compile, 52 in another).
    The tables cost ``positions`` x ``head_dim`` x 4 bytes: 32 MiB for all of llama-1b's 131072
    positions, so the engine and the package builder size them to ``max_model_len``."""
    freqs = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq[None, :]
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (halves rotated, HF layout); cos, sin: [T, D // 2] float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """``cfg``: this rank's config (its heads only, under tensor parallelism): q/k/v column-parallel,
    o row-parallel (the all-reduce after attention)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = column_linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.qkv_bias, tp)
        self.wo = row_linear(cfg.n_heads * cfg.head_dim, cfg.dim, tp)
        self.scale = cfg.head_dim ** -0.5
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # weights [head_dim], shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # bound by Transformer.bind_kv_cache: [num_pages, page_size, n_kv_heads, head_dim]
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        rows = x.shape[0]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(rows, self.n_heads, self.head_dim), k.view(rows, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(rows, self.n_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        ctx.attention.forward(self.layer_id, ctx.attention_mode, q, k, v, self.k_cache, self.v_cache, out, self.scale)
        return self.wo(out.view(rows, q_size))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel (the all-reduce after the MLP)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.w13 = column_linear(cfg.dim, 2 * cfg.intermediate_size, False, tp)
        self.w2 = row_linear(cfg.intermediate_size, cfg.dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id, tp)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward`` = encoder_forward -> narrowing_forward -> decoder_forward -> finish_forward.

    "Encoder" and "decoder" are the CED model's names for the layers before and after the row
    narrowing (not an encoder-decoder architecture); the split pass and the prefill graphs use the
    same two stage names.

    For a plain decoder the narrowing is the identity and every layer is an encoder layer; the
    narrowing model (``models/narrow.py``) overrides the middle.

    ``tp``: this process's rank of a tensor-parallel group (``models/parallel.py``), or None. A rank's
    model holds its shard: ``config`` is then the shard's (its heads and MLP width, what the runtime
    sizes the cache and attention by) and ``full_config`` the whole model's; the logits are the whole
    vocabulary's on every rank."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.full_config = cfg
        if tp is not None:
            cfg = ShardLayout(cfg, tp.rank, tp.size).local_config()
        self.config = cfg
        self.tok_embeddings = embedding(self.full_config, tp)
        self.layers = nn.ModuleList(Block(cfg, i, tp) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = lm_head(self.full_config, tp)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for name in ("inv_freq", "rope_cos", "rope_sin"):  # filled by reset_rope, on the weights' device
            self.register_buffer(name, None, persistent=False)
        self.reset_rope(self.tok_embeddings.weight.device)

    def reset_rope(self, device: torch.device | str, positions: int | None = None) -> None:
        """RoPE's frequencies and tables, recomputed in float32 on ``device``: a cast of the model to
        a lower dtype (or ``to_empty``) leaves them rounded or uninitialised. ``positions``: table
        rows, default the config's ``max_position``; the engine passes its ``max_model_len`` (a
        position at or past it is never run, so the rest of the table would be dead memory)."""
        limit = self.config.max_position
        positions = limit if positions is None else positions
        if not 1 <= positions <= limit:
            raise ValueError(f"tscompile: RoPE tables of {positions} positions; expected 1 to the model's "
                             f"max_position {limit}")
        self.inv_freq = rope_frequencies(self.config).float().to(device)
        self.rope_cos, self.rope_sin = rope_tables(self.inv_freq, positions)

    # -- structure the runtime reads ---------------------------------------------------------------
    @property
    def num_encoder_layers(self) -> int:
        return self.config.n_layers

    def cache_groups(self) -> list[CacheGroupSpec]:
        cfg = self.config
        return [CacheGroupSpec("full", tuple(range(cfg.n_layers)), cfg.n_kv_heads, cfg.head_dim)]

    def bind_kv_cache(self, pool: KVCachePool) -> None:
        for layer in self.layers:
            attn = layer.attention
            attn.k_cache, attn.v_cache = pool.layer_cache(attn.layer_id)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Transformer":
        """Seeded random weights; a tensor-parallel rank draws each whole tensor and keeps its shard,
        so every rank's shard is that of the one-device model of the same seed."""
        gen = torch.Generator(device=self.tok_embeddings.weight.device).manual_seed(seed)
        layout = None if self.tp is None else ShardLayout(self.full_config, self.tp.rank, self.tp.size)
        if layout is not None:
            with torch.device("meta"):
                full_shapes = {n: p.shape for n, p in Transformer(self.full_config).named_parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                shape = p.shape if layout is None else full_shapes[name]
                w = torch.randn(shape, generator=gen, device=p.device, dtype=torch.float32) * std
                p.copy_(w if layout is None else layout.shard(name, w))
        return self

    # -- the forward, as four stages --------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim // 2]`` float32 of each row's position (``rope_tables``' rows)."""
        if self.rope_cos.dtype != torch.float32:  # a trace-time check: no work in a compiled step
            raise ValueError(f"tscompile: RoPE tables are {self.rope_cos.dtype}, not float32 (a cast of the whole "
                             "model rounds them); call model.reset_rope(device) after casting")
        return self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        cos, sin = self.rope(positions)
        for layer in self.layers[start:stop]:
            h = layer(h, cos, sin)
        return h

    def encoder_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.tok_embeddings(input_ids), positions, 0, self.num_encoder_layers)

    def narrowing_forward(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, positions

    def decoder_forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.run_layers(h, positions, self.num_encoder_layers, self.config.n_layers)
        return self.norm(h)

    def finish_forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of each request's sampled row (``ctx.logits_rows``): ``[B, vocab]`` float32."""
        return self.output(h.index_select(0, get_forward_context().logits_rows)).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.encoder_forward(input_ids, positions)
        h, positions = self.narrowing_forward(h, positions)
        h = self.decoder_forward(h, positions)
        return self.finish_forward(h)


def build_config(preset: str, **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"tscompile: unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    return replace(PRESETS[preset], **overrides)
