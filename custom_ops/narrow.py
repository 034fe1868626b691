"""``tscompile::narrow_rows``: the row narrowing of the CED-style model.

Per request (rows ``qo_indptr[b]:qo_indptr[b + 1]``) it keeps the last ``min(window, q_len)`` rows of
a chunk that completes its prompt and the last row otherwise (an open chunk, or a decode row).
The kept count depends on the batch, not on the token count, so the fake kernel returns an
unbacked size.

    x:          [T, H]    rows to narrow
    positions:  [T] int64 their true positions (RoPE after the narrowing still uses them)
    qo_indptr:  [B + 1] int32
    completes:  [B] bool  this chunk completes the request's prompt
    returns     ([R, H], [R] int64)
"""

from __future__ import annotations

import torch


def kept_row_mask(qo_indptr: torch.Tensor, completes: torch.Tensor, window: int, num_rows: int) -> torch.Tensor:
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    keep = torch.where(completes, torch.clamp(q_lens, max=window), torch.clamp(q_lens, max=1))
    rows = torch.arange(num_rows, device=qo_indptr.device)
    req = torch.bucketize(rows, qo_indptr[1:].long(), right=True)
    req = torch.clamp(req, max=q_lens.shape[0] - 1)
    # rows past qo_indptr[-1] pad a token bucket and belong to no request: never kept
    return (rows >= (qo_indptr[1:].long() - keep)[req]) & (rows < qo_indptr[-1])


@torch.library.custom_op("tscompile::narrow_rows", mutates_args=())
def narrow_rows(
    x: torch.Tensor, positions: torch.Tensor, qo_indptr: torch.Tensor, completes: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    keep = kept_row_mask(qo_indptr, completes, window, x.shape[0]).nonzero()[:, 0]
    return x.index_select(0, keep), positions.index_select(0, keep)


@narrow_rows.register_fake
def _(x, positions, qo_indptr, completes, window):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:])), positions.new_empty((rows,))
