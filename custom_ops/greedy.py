"""Greedy tokens with banned ids, in two Triton kernels instead of building a ``[B, V]`` mask.

``argmax(logits.masked_fill(banned_mask(banned, V), -inf))`` launches seven small kernels and
writes the logits once more, every decode step, although a row bans a few ids at most. Here the
bans are applied while the logits are read: the first kernel reduces each chunk of a row to its
maximum and the first index holding it, the second picks the first of the chunks' winners. The
result is bit-identical to ``torch.argmax`` over the masked logits: ties go to the lowest index, a
row whose every entry is -inf gives 0, and a NaN wins at its first position, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits per program of the first kernel: 32 chunks for a 128k vocabulary


@triton.jit
def _chunk_argmax_kernel(logits_ptr, banned_ptr, part_val_ptr, part_idx_ptr, vocab, stride_row,
                         K: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab
    x = tl.load(logits_ptr + row * stride_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
    for k in tl.static_range(K):
        ban = tl.load(banned_ptr + row * K + k)  # -1 pads and ids outside [0, V) match no offset
        x = tl.where(offs == ban, float("-inf"), x)
    big = vocab + CHUNK  # above every index
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & inside, offs, big), axis=0)
    best = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first_best = tl.min(tl.where((x == best) & inside, offs, big), axis=0)
    has_nan = first_nan < big
    tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, float("nan"), best))
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, first_nan, first_best))


@triton.jit
def _pick_chunk_kernel(part_val_ptr, part_idx_ptr, out_ptr, big, NUM_CHUNKS: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    live = c < NUM_CHUNKS
    val = tl.load(part_val_ptr + row * NUM_CHUNKS + c, mask=live, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=live, other=big)
    is_nan = (val != val) & live
    first_nan = tl.min(tl.where(is_nan, idx, big), axis=0)
    best = tl.max(tl.where(is_nan, float("-inf"), val), axis=0)
    first_best = tl.min(tl.where((val == best) & live, idx, big), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < big, first_nan, first_best).to(tl.int64))


def greedy_tokens_with_bans(logits: torch.Tensor, banned: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b] = argmax(logits[b] with banned[b] ids at -inf)``; ``logits`` rows contiguous."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    banned = banned.contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](logits, banned, part_val, part_idx, vocab, logits.stride(0),
                                             K=banned.shape[1], CHUNK=CHUNK, NUM_CHUNKS=num_chunks)
    _pick_chunk_kernel[(rows,)](part_val, part_idx, out, vocab + CHUNK, NUM_CHUNKS=num_chunks,
                                BLOCK=triton.next_power_of_2(num_chunks))
