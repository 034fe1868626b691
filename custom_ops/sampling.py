"""``tscompile::sample``: the one sampling route. Greedy is ``top_k == 1`` (or temperature 0).

Randomness comes from a counter-based hash of ``(seed, step)``, not from a generator's state, so a
request's tokens depend only on its own seed and position: batched equals one-at-a-time, eager
equals replay, and the op is safe inside a captured graph.

    logits:      [B, V] float    the rows to sample
    temperature: [B] float32     <= 0 means greedy
    top_k:       [B] int32       0 means the whole vocabulary; 1 is greedy
    top_p:       [B] float32     in (0, 1]
    seeds:       [B] int64
    steps:       [B] int64       a per-request counter (the position being sampled)
    out:         [B] int64       mutated: the sampled token ids (a persistent buffer's slice)
    all_greedy:  a static promise that every row is greedy; the op then takes the argmax without
                 sorting the vocabulary (the same tokens the general path gives greedy rows)
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def uniform_from_counter(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A float64 in [0, 1) per row from a 32-bit integer hash; no int64 product ever overflows."""
    h = (seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)
    h = (h ^ ((steps & 0x7FFFFFFF) * 0x9E3779B1)) & _MASK32
    for _ in range(3):
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float64) / float(1 << 24)


def sample_tokens(logits, temperature, top_k, top_p, seeds, steps) -> torch.Tensor:
    vocab = logits.shape[-1]
    greedy = (temperature <= 0) | (top_k == 1)
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits.float() / temp[:, None]
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k <= 0, vocab, top_k).long()
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before > top_p.float()[:, None], 0.0)
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = uniform_from_counter(seeds, steps) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    choice = torch.clamp(choice, max=vocab - 1)
    choice = torch.where(greedy, torch.zeros_like(choice), choice)
    return sorted_ids.gather(1, choice[:, None])[:, 0]


@torch.library.custom_op("tscompile::sample", mutates_args=("out",))
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out: torch.Tensor,
    all_greedy: bool = False,
) -> None:
    if all_greedy:
        out.copy_(torch.argmax(logits, dim=-1))
    else:
        out.copy_(sample_tokens(logits, temperature, top_k, top_p, seeds, steps))


@sample.register_fake
def _(logits, temperature, top_k, top_p, seeds, steps, out, all_greedy=False):
    return None
