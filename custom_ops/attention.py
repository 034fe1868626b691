"""``tscompile::attention``: write this forward's K/V into the paged cache, then attend.

One schema serves decode, extend (with a cached prefix) and mixed batches. Every tensor is an
explicit argument, so fake kernels, export and graph capture all see them.

Layout (one layer, one cache group):
    q:          [T, Hq, D]            the new query rows, request-major
    k, v:       [T, Hkv, D]           the new key/value rows
    k_cache:    [num_pages, P, Hkv, D] mutated: rows written at ``write_loc``
    v_cache:    [num_pages, P, Hkv, D] mutated
    out:        [T, Hq, D]            mutated: attention output (caller-provided)
    page_table: [B, max_pages] int32  kernel pages, batch-ordered, padded with the null page 0
    seq_lens:   [B] int32             KV length of each request after this forward's writes
    qo_indptr:  [B + 1] int32         query rows of request b are qo_indptr[b]:qo_indptr[b + 1]
    write_loc:  [T] int64             cache slot (page * P + offset) of each new row
    decode:     every request has the same number N = T / B of query rows (qo_indptr == arange * N):
                N = 1 is plain decode, N > 1 a speculative verify window; kernels may take a
                graph-safe path that never reads the host (N comes from the static shapes)
    impl:       which registered kernel runs ("torch", "triton", ...)

Query row ``i`` of request ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and attends causally
to positions ``[0, that position]``. A request with ``seq_lens == 0`` (a padded decode row) gets zeros.
Rows ``>= qo_indptr[-1]`` (a prefill padded to a token bucket) write their K/V to their write slot
(the null page) and get zeros.
"""

from __future__ import annotations

from typing import Callable

import torch
from tscompile.utils import cdiv

AttentionImpl = Callable[..., None]
_IMPLS: dict[str, AttentionImpl] = {}
_ZEROES_PADDING: set[str] = set()  # impls whose extend zeroes the rows past qo_indptr[-1] itself


def register_attention_impl(name: str, fn: AttentionImpl, *, zeroes_padding: bool = False) -> None:
    """Make ``fn(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc,
    scale, decode)`` reachable as ``impl=name``. ``zeroes_padding``: its extend already writes
    zeros to the rows past ``qo_indptr[-1]`` (in a kernel it launches anyway); otherwise
    ``run_attention`` zeroes them after it, with three more device ops per layer."""
    _IMPLS[name] = fn
    if zeroes_padding:
        _ZEROES_PADDING.add(name)
    else:
        _ZEROES_PADDING.discard(name)


def attention_impls() -> list[str]:
    return sorted(_IMPLS)


def decode_width(q: torch.Tensor, page_table: torch.Tensor) -> int:
    """N, the query rows per request of a decode (verify window) call: ``T / B`` from static shapes.
    Refuses a row count that is not a whole number of windows."""
    rows, requests = q.shape[0], page_table.shape[0]
    if requests == 0:
        return 1
    if rows % requests:
        raise ValueError(f"tscompile: a decode attention call has {rows} query rows for {requests} requests; "
                         f"every request needs the same window width, so rows must be a multiple of {requests}")
    return max(rows // requests, 1)


def run_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale: float,
                  decode: bool, impl: str) -> None:
    """The op's body, callable without the dispatcher: eager callers (the runtime's attention breaks)
    use it directly; graphs and exported programs record the op, which runs this."""
    fn = _IMPLS.get(impl)
    if fn is None:
        raise ValueError(f"tscompile: unknown attention impl {impl!r}; known: {attention_impls()}")
    if decode:
        decode_width(q, page_table)
    fn(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode)
    if not decode and q.shape[0] > 0 and impl not in _ZEROES_PADDING:
        # rows past qo_indptr[-1] pad a token bucket: zero them on the device, without a host read
        rows = torch.arange(q.shape[0], device=q.device)
        out.masked_fill_((rows >= qo_indptr[-1])[:, None, None], 0)


@torch.library.custom_op("tscompile::attention", mutates_args=("k_cache", "v_cache", "out"))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    write_loc: torch.Tensor,
    scale: float,
    decode: bool,
    impl: str,
) -> None:
    run_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode, impl)


@attention.register_fake
def _(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode, impl):
    if decode:
        decode_width(q, page_table)
    return None


# ----------------------------------------------------------------------------------------------
# The torch implementation: pure PyTorch over the paged cache, any device. It is the oracle, so it
# computes in float32 (float64 when given float64) and favours plainness over speed. Its decode
# path never syncs with the host, so it can run inside a captured graph.


def write_kv(k, v, k_cache, v_cache, write_loc) -> None:
    """Scatter the new rows into the cache: flat slot ``s`` is ``cache.view(-1, Hkv, D)[s]``."""
    hkv, d = k_cache.shape[-2:]
    k_cache.view(-1, hkv, d).index_copy_(0, write_loc, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, write_loc, v.to(v_cache.dtype))


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _torch_decode(q, k_cache, v_cache, out, page_table, seq_lens, scale) -> None:
    """Every request has N = T / B query rows (N = 1: plain decode; N > 1: a verify window): row
    ``i`` of request ``b`` sits at position ``seq_lens[b] - N + i`` and sees positions up to it."""
    bs = page_table.shape[0]
    if bs == 0 or q.shape[0] == 0:
        return
    t, hq, d = q.shape
    width = t // bs
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    acc = _acc_dtype(q)
    slots = (page_table.long()[:, :, None] * page_size + torch.arange(page_size, device=q.device))
    slots = slots.reshape(bs, -1)  # [B, S]
    keys = k_cache.view(-1, hkv, d)[slots].to(acc)  # [B, S, Hkv, D]
    vals = v_cache.view(-1, hkv, d)[slots].to(acc)
    qg = q.to(acc).view(bs, width, hkv, hq // hkv, d)
    scores = torch.einsum("bnhgd,bshd->bnhgs", qg, keys) * scale
    positions = torch.arange(slots.shape[1], device=q.device)  # [S]
    in_len = positions[None, :] < seq_lens[:, None]  # [B, S]
    q_pos = seq_lens[:, None].long() - width + torch.arange(width, device=q.device)  # [B, N]
    visible = in_len[:, None, :] & (positions[None, None, :] <= q_pos[:, :, None])  # [B, N, S]
    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # seq_len 0 rows: all -inf -> zeros
    # slots past seq_len hold whatever the pool held (maybe NaN): 0 * NaN would leak, so zero them
    vals = vals.masked_fill(~in_len[:, :, None, None], 0.0)
    o = torch.einsum("bnhgs,bshd->bnhgd", probs, vals)
    out.copy_(o.reshape(t, hq, d).to(out.dtype))


def _torch_extend(q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale) -> None:
    hq, d = q.shape[1:]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    acc = _acc_dtype(q)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    indptr, lens = qo_indptr.tolist(), seq_lens.tolist()
    for b, kv_len in enumerate(lens):
        start, end = indptr[b], indptr[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if kv_len == 0:
            out[start:end] = 0
            continue
        n_pages = cdiv(kv_len, page_size)
        pages = page_table[b, :n_pages].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=q.device)).reshape(-1)
        keys = flat_k[slots[:kv_len]].to(acc).repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
        vals = flat_v[slots[:kv_len]].to(acc).repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start:end].to(acc), keys) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        causal = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vals)
        out[start:end] = o.to(out.dtype)


def torch_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc,
                    scale, decode) -> None:
    write_kv(k, v, k_cache, v_cache, write_loc)
    if decode:
        _torch_decode(q, k_cache, v_cache, out, page_table, seq_lens, scale)
    else:
        _torch_extend(q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, scale)


register_attention_impl("torch", torch_attention)
