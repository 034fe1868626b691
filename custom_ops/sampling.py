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
    banned:      [B, K] int64    per row, token ids whose logit becomes -inf before greedy argmax or
                                 sampling (``min_tokens`` keeps stop ids out); -1 pads; K >= 1 is
                                 fixed per engine so graphs keep one shape. Ids outside [0, V) are
                                 ignored like -1. A row that bans every id gets token 0 (greedy) or
                                 an undefined choice (sampled): callers ban a few ids, never all.
    out:         [B] int64       mutated: the sampled token ids (a persistent buffer's slice)
    all_greedy:  a static promise that every row is greedy; the op then takes the argmax without
                 sorting the vocabulary (the same tokens the general path gives greedy rows)
"""

from __future__ import annotations

from collections.abc import Sequence

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


def banned_mask(banned: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` bool, True at each row's banned ids; static shapes, no host reads.

    Padding (-1) and out-of-range ids scatter into a spare column ``vocab`` that is sliced off, so
    every scattered value is True and repeated indices cannot race a False over a real ban."""
    valid = (banned >= 0) & (banned < vocab)
    index = torch.where(valid, banned, vocab)
    mask = torch.zeros(banned.shape[0], vocab + 1, dtype=torch.bool, device=banned.device)
    return mask.scatter_(1, index, True)[:, :vocab]


def pad_banned(rows: list[Sequence[int]], width: int) -> torch.Tensor:
    """Host helper: ``[len(rows), width]`` int64 of each row's ids padded with -1 (for ``banned``).

    Refuses a row longer than ``width``: the engine fixes ``width`` and must refuse such a request
    when it is added, before anything runs."""
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if len(ids) > width:
            raise ValueError(f"tscompile: {len(ids)} banned token ids {list(ids)!r} in row {i}; the engine "
                             f"masks at most {width} per row")
        out[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
    return out


def filtered_sorted_probs(logits, temperature, top_k, top_p):
    """The temperature / top-k / top-p filter every sampling route shares (``tscompile::sample`` and
    the rejection sampler of speculative decoding), over the logits sorted in descending order.

    Returns ``(probs [R, V] float32, unnormalized after top-p, sorted_ids [R, V] int64, greedy [R]
    bool, rank [1, V] int64)``; a greedy row (temperature <= 0 or top_k == 1) is left to the caller."""
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
    return probs, sorted_ids, greedy, rank


def sample_tokens(logits, temperature, top_k, top_p, seeds, steps) -> torch.Tensor:
    vocab = logits.shape[-1]
    probs, sorted_ids, greedy, _ = filtered_sorted_probs(logits, temperature, top_k, top_p)
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
    banned: torch.Tensor,
    out: torch.Tensor,
    all_greedy: bool = False,
) -> None:
    if all_greedy and logits.is_cuda and out.is_contiguous():
        # the same tokens as the argmax below, in two kernels with no [B, V] mask (custom_ops/greedy.py)
        from tscompile.custom_ops.greedy import greedy_tokens_with_bans
        greedy_tokens_with_bans(logits, banned, out)
        return
    # masked_fill leaves every unbanned logit bit-identical, so all -1 gives the unmasked tokens
    logits = logits.masked_fill(banned_mask(banned, logits.shape[-1]), float("-inf"))
    if all_greedy:
        out.copy_(torch.argmax(logits, dim=-1))
    else:
        out.copy_(sample_tokens(logits, temperature, top_k, top_p, seeds, steps))


@sample.register_fake
def _(logits, temperature, top_k, top_p, seeds, steps, banned, out, all_greedy=False):
    return None
