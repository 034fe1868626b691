"""A gpt-fast-style static-KV-cache view of a ``tscompile.models.Transformer`` (the torch.compile baselines).

It owns no weights: every ``nn.Linear``/``nn.Embedding``/``RMSNorm`` is the tscompile model's own module
(so q/k/v biases, Qwen3's q/k norms and a free head_dim come with it), and RoPE is the model's
``rope``/``apply_rope`` (any ``rope_frequencies`` scaling type), so its greedy tokens match
``tscompile.LLM``'s. The only state it adds is the cache: per layer ``k_cache, v_cache: [B, n_kv_heads, max_len, head_dim]`` buffers,
written with ``index_copy_`` at ``input_pos`` and read whole by SDPA under a causal mask.

All requests of a batch share positions (equal prompt lengths), as in gpt-fast's batched generate.

Grouped-query attention, two formulations (``gqa``):
  ``"repeat_interleave"``  gpt-fast's model.py: K and V repeated to one copy per query head, then SDPA
                           (the straightforward baseline; it copies the whole cache every step)
  ``"enable_gqa"``         ``F.scaled_dot_product_attention(..., enable_gqa=True)`` (torch >= 2.5) reads
                           the ``n_kv_heads`` cache as it is
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tscompile.models.llama import Transformer, apply_rope


GQA_FORMULATIONS = ("repeat_interleave", "enable_gqa")


class StaticAttention(nn.Module):
    def __init__(self, attn: nn.Module, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 gqa: str = "repeat_interleave"):
        super().__init__()
        self.gqa = gqa
        self.wqkv, self.wo = attn.wqkv, attn.wo
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.qk_norm = attn.qk_norm
        if attn.qk_norm:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        shape = (batch_size, self.n_kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)  # wqkv carries the q/k/v biases
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # apply_rope takes [..., T, H, D] with cos/sin [T, D/2]: [B, S, H, D] broadcasts over B
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, input_pos, v.to(self.v_cache.dtype))
        if self.gqa == "enable_gqa":  # q head h reads kv head h // group inside SDPA
            y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.n_heads != self.n_kv_heads)
        else:
            group = self.n_heads // self.n_kv_heads
            keys = self.k_cache.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
            vals = self.v_cache.repeat_interleave(group, dim=1)
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, q_size))


class StaticBlock(nn.Module):
    def __init__(self, block: nn.Module, batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 gqa: str):
        super().__init__()
        self.attention_norm, self.ffn_norm, self.feed_forward = block.attention_norm, block.ffn_norm, block.feed_forward
        self.attention = StaticAttention(block.attention, batch_size, max_len, dtype, device, gqa)

    def forward(self, x, cos, sin, input_pos, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class StaticCacheModel(nn.Module):
    """``forward(input_ids [B, S], input_pos [S]) -> logits [B, vocab]`` (float32, last row only)."""

    def __init__(self, model: Transformer, batch_size: int, max_len: int, gqa: str = "repeat_interleave"):
        super().__init__()
        cfg = model.config
        if gqa not in GQA_FORMULATIONS:
            raise ValueError(f"tscompile: gqa={gqa!r} is not a GQA formulation; allowed: {GQA_FORMULATIONS}")
        if cfg.narrow_layer is not None:
            raise ValueError("tscompile: the static-cache baseline has no narrowing; use a plain Llama preset")
        if max_len > cfg.max_position:
            raise ValueError(f"tscompile: static cache length {max_len} exceeds max_position {cfg.max_position}")
        self.config, self.batch_size, self.max_len = cfg, batch_size, max_len
        self.source = [model]  # a list, so the source is not a submodule (its paged buffers stay out)
        weight = model.tok_embeddings.weight
        self.tok_embeddings, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.layers = nn.ModuleList(StaticBlock(b, batch_size, max_len, weight.dtype, weight.device, gqa)
                                    for b in model.layers)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        src = self.source[0]
        cos, sin = src.rope(input_pos)
        max_len = self.layers[0].attention.k_cache.shape[2]  # a tensor size, so it may stay dynamic under compile
        mask = torch.arange(max_len, device=input_pos.device)[None, :] <= input_pos[:, None]  # [S, max_len]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, input_pos, mask)
        return self.output(self.norm(h[:, -1])).float()
