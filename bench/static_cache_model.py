"""A gpt-fast-style static-KV-cache view of a ``tscompile.models.Transformer`` (the torch.compile baselines).

It owns no weights: every ``nn.Linear``/``nn.Embedding``/``RMSNorm`` is the tscompile model's own module
(so q/k/v biases, Qwen3's q/k norms and a free head_dim come with it), and RoPE is the model's
``rope``/``apply_rope`` (any ``rope_frequencies`` scaling type), so its greedy tokens match
``tscompile.LLM``'s. The only state it adds is the cache: per layer ``k_cache, v_cache: [B, n_kv_heads, max_len, head_dim]`` buffers,
written with ``index_copy_`` at the rows' positions.

Two entry points, as a torch.compile user writes them:
  ``prefill(input_ids)``          a prompt from position 0: SDPA ``is_causal=True`` over the prompt's own K/V
                                  (the cache is only written), so a prefill costs the causal half of
                                  S x S and nothing over the rest of the static cache
  ``forward(input_ids, input_pos)`` rows at any positions (decode): SDPA over the whole static cache under
                                  a mask of the positions written so far, gpt-fast's decode

All requests of a batch share positions (equal prompt lengths), as in gpt-fast's batched generate.

Grouped-query attention, three formulations (``gqa``):
  ``"repeat_interleave"``   gpt-fast's model.py: K and V repeated to one copy per query head, then SDPA
                            (the straightforward baseline; it copies the whole cache every step)
  ``"enable_gqa"``          ``F.scaled_dot_product_attention(..., enable_gqa=True)`` (torch >= 2.5): the
                            ``n_kv_heads`` cache as it is, when a fused kernel takes it
  ``"grouped_query_rows"``  a kv head's ``group`` query heads as ``group`` times as many query rows of that
                            head (``[B, n_kv_heads, S * group, D]``, the mask repeated per row): plain SDPA
                            over the cache as it is, with any kernel that takes a mask
With a mask (the static cache needs one) flash attention is out, and SDPA's math fallback implements
``enable_gqa`` by repeating K and V per head, i.e. the copy again: ``choose_gqa`` asks SDPA's dispatcher
which kernel ``enable_gqa`` would get and takes ``grouped_query_rows`` where it is the math one.
A prefill has no mask (``is_causal``): ``repeat_interleave`` copies there too, the two others pass
``enable_gqa`` (a query row fold would need a mask again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tscompile.models.llama import Transformer, apply_rope


GQA_FORMULATIONS = ("repeat_interleave", "enable_gqa", "grouped_query_rows")


def enable_gqa_kernel(n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """The SDPA kernel the dispatcher picks for ``enable_gqa=True`` with a boolean mask at a decode
    (1 query row) and a prefill (16 rows) shape, or None where either is the math fallback."""
    from torch.nn.attention import SDPBackend

    names = []
    for rows in (1, 16):
        q = torch.zeros(1, n_heads, rows, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(1, n_kv_heads, 64, head_dim, dtype=dtype, device=device)
        mask = torch.ones(rows, 64, dtype=torch.bool, device=device)
        try:
            choice = SDPBackend(torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, enable_gqa=True))
        except Exception:  # noqa: BLE001  (a torch without the dispatcher query: do not rely on enable_gqa)
            return None
        if choice in (SDPBackend.MATH, SDPBackend.ERROR):
            return None
        names.append(choice.name.lower())
    return "/".join(dict.fromkeys(names))


def choose_gqa(model: Transformer) -> tuple[str, str]:
    """The tuned baseline's GQA formulation for ``model``'s dtype and device, and why."""
    cfg, weight = model.config, model.tok_embeddings.weight
    if cfg.n_heads == cfg.n_kv_heads:
        return "enable_gqa", "no grouped heads"
    kernel = enable_gqa_kernel(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, weight.dtype, weight.device)
    if kernel is None:
        return "grouped_query_rows", ("SDPA would run enable_gqa with a mask in its math fallback, which "
                                      "repeats K/V per head")
    return "enable_gqa", f"SDPA runs enable_gqa with a mask in {kernel}"


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
                mask: torch.Tensor | None) -> torch.Tensor:
        """``x: [B, S, dim]`` at ``input_pos: [S]``; ``mask: [S, max_len]`` bool over the static cache,
        or None for a prompt from position 0 (causal attention over its own K/V)."""
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)  # wqkv carries the q/k/v biases
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # apply_rope takes [..., T, H, D] with cos/sin [T, D/2]: [B, S, H, D] broadcasts over B
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        self.k_cache.index_copy_(2, input_pos, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, input_pos, v.to(self.v_cache.dtype))
        group = self.n_heads // self.n_kv_heads  # q head h reads kv head h // group
        if mask is None:
            return self.wo(self._prompt_attention(q.transpose(1, 2), k, v, group).transpose(1, 2)
                           .reshape(bsz, seqlen, q_size))
        if self.gqa == "grouped_query_rows":
            # row s * group + g of kv head j is query head j * group + g at position s
            rows = q.reshape(bsz, seqlen, self.n_kv_heads, group, self.head_dim).transpose(1, 2)
            rows = rows.reshape(bsz, self.n_kv_heads, seqlen * group, self.head_dim)
            y = F.scaled_dot_product_attention(rows, self.k_cache, self.v_cache,
                                               attn_mask=mask.repeat_interleave(group, dim=0), scale=self.scale)
            return self.wo(y.reshape(bsz, self.n_kv_heads, seqlen, group * self.head_dim).transpose(1, 2)
                           .reshape(bsz, seqlen, q_size))
        q = q.transpose(1, 2)
        if self.gqa == "enable_gqa":
            y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, scale=self.scale,
                                               enable_gqa=group > 1)
        else:
            keys = self.k_cache.repeat_interleave(group, dim=1)
            vals = self.v_cache.repeat_interleave(group, dim=1)
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, q_size))

    def _prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
        """Causal attention of a prompt over itself: ``q: [B, n_heads, S, D]``, ``k, v: [B, n_kv_heads, S, D]``
        (the rows just written to the cache, in the cache's dtype) -> ``[B, n_heads, S, D]``."""
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        if self.gqa == "repeat_interleave":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=group > 1)


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
    """``forward(input_ids [B, S], input_pos [S]) -> logits [B, vocab]`` (float32, last row only);
    ``prefill(input_ids [B, S])``: the same for a prompt at positions ``0 .. S-1``, attended causally
    over itself."""

    def __init__(self, model: Transformer, batch_size: int, max_len: int, gqa: str = "repeat_interleave"):
        super().__init__()
        cfg = model.config
        if gqa not in GQA_FORMULATIONS:
            raise ValueError(f"tscompile: gqa={gqa!r} is not a GQA formulation; allowed: {GQA_FORMULATIONS}")
        if cfg.narrow_layer is not None:
            raise ValueError("tscompile: the static-cache baseline has no narrowing; use a plain Llama preset")
        if getattr(cfg, "layer_types", None) is not None:  # a hybrid's linear-attention layers
            raise ValueError("tscompile: the static-cache baseline has no linear-attention (Gated DeltaNet) layers, "
                             "so the engine bench has no stock baseline of a hybrid Qwen3-Next model; measure "
                             "stock torch.compile of transformers' model of the shape with "
                             "`tscompile bench --hf-model PRESET` (qwen3-next-tiny, qwen3-next-1b)")
        if max_len > cfg.max_position:
            raise ValueError(f"tscompile: static cache length {max_len} exceeds max_position {cfg.max_position}")
        self.config, self.batch_size, self.max_len = cfg, batch_size, max_len
        self.source = [model]  # a list, so the source is not a submodule (its paged buffers stay out)
        weight = model.tok_embeddings.weight
        self.tok_embeddings, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.layers = nn.ModuleList(StaticBlock(b, batch_size, max_len, weight.dtype, weight.device, gqa)
                                    for b in model.layers)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        max_len = self.layers[0].attention.k_cache.shape[2]  # a tensor size, so it may stay dynamic under compile
        mask = torch.arange(max_len, device=input_pos.device)[None, :] <= input_pos[:, None]  # [S, max_len]
        return self._run(input_ids, input_pos, mask)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self._run(input_ids, input_pos, None)

    def _run(self, input_ids: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cos, sin = self.source[0].rope(input_pos)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, input_pos, mask)
        return self.output(self.norm(h[:, -1])).float()
