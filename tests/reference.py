"""A dense, unpaged re-implementation of the reference models' math (float64), for the tests.

It reuses a built model's weights but none of its attention plumbing: every step recomputes the
whole sequence with plain causal attention, so a paging, slot or metadata bug cannot hide in both.
"""

from __future__ import annotations

import torch

from tscompile.models.llama import Transformer, apply_rope


def _dense_attention(attn, x, positions):
    rows = x.shape[0]
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q, k, v = attn.wqkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k = q.view(rows, nh, hd), k.view(rows, nkv, hd)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v.view(rows, nkv, hd)


def _block(block, model, h, positions):
    attn = block.attention
    cos, sin = model.rope(positions)
    q, k, v = _dense_attention(attn, block.attention_norm(h), positions)
    q, k = apply_rope(q, cos, sin).double(), apply_rope(k, cos, sin).double()
    rep = attn.n_heads // attn.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) * attn.scale
    causal = positions[None, :] <= positions[:, None]
    s = s.masked_fill(~causal[None], float("-inf"))
    o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v).to(h.dtype)
    h = h + attn.wo(o.reshape(h.shape[0], -1))
    return h + block.feed_forward(block.ffn_norm(h))


@torch.no_grad()
def dense_last_logits(model: Transformer, tokens: list[int], kept_positions: list[int] | None = None) -> torch.Tensor:
    """Logits of the last token. For the narrowing model, ``kept_positions`` are the positions the
    tail group holds (the decoder layers run on those rows only)."""
    device = model.tok_embeddings.weight.device
    ids = torch.tensor(tokens, device=device)
    pos = torch.arange(len(tokens), device=device)
    h = model.tok_embeddings(ids)
    k = model.num_encoder_layers
    for block in model.layers[:k]:
        h = _block(block, model, h, pos)
    if k < model.config.n_layers:
        keep = torch.tensor(kept_positions, device=device)
        h, pos = h[keep], pos[keep]
        for block in model.layers[k:]:
            h = _block(block, model, h, pos)
    return model.output(model.norm(h)[-1]).double()


def dense_greedy(model: Transformer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens with unchunked prefill (the narrowing model keeps the prompt's last W rows)."""
    window = model.config.narrow_window
    tokens, kept, out = list(prompt), list(range(max(0, len(prompt) - window), len(prompt))), []
    for _ in range(max_new_tokens):
        nxt = int(dense_last_logits(model, tokens, kept).argmax())
        out.append(nxt)
        kept.append(len(tokens))
        tokens.append(nxt)
    return out
