"""The CED-style narrowing model: a prefill whose row count drops once, at a fixed layer.

Layers ``[0, k)`` (encoder) run on every row and use the full cache group. ``tscompile::narrow_rows``
then keeps, per request, the last ``min(W, q_len)`` rows of a prompt-completing chunk, the last row
of an open chunk, and every decode row. Layers ``[k, L)`` (decoder) run on the kept rows only and
use the tail cache group, whose per-request sequence holds only kept positions (RoPE still uses the
true positions). The kept count depends on the batch, not on the token count.
"""

from __future__ import annotations

import torch

from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models.llama import ModelConfig, Transformer
from tscompile.forward_context import get_forward_context


class NarrowingTransformer(Transformer):
    def __init__(self, cfg: ModelConfig):
        if cfg.narrow_layer is None:
            raise ValueError("tscompile: NarrowingTransformer needs config.narrow_layer")
        super().__init__(cfg)

    @property
    def num_encoder_layers(self) -> int:
        return self.config.narrow_layer

    def cache_groups(self) -> list[CacheGroupSpec]:
        cfg = self.config
        k = cfg.narrow_layer
        return [
            CacheGroupSpec("full", tuple(range(k)), cfg.n_kv_heads, cfg.head_dim),
            CacheGroupSpec("tail", tuple(range(k, cfg.n_layers)), cfg.n_kv_heads, cfg.head_dim, window=cfg.narrow_window),
        ]

    def narrowing_forward(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = get_forward_context()
        if ctx.attention_mode.is_decode:  # every decode row is kept (EXTEND and MIXED share one graph)
            return h, positions
        return torch.ops.tscompile.narrow_rows(h, positions, ctx.qo_indptr, ctx.completes, self.config.narrow_window)
