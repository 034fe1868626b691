"""The ``triton`` implementation of ``tscompile::refresh_decode_metadata``: one fused launch.

``torch_refresh`` (the oracle, ``custom_ops/metadata.py``) is a handful of small launches; this does
the same work in a single kernel whose arguments are the buffers plus plain integers taken from
static shapes, so it never reads the host and replays the same under a CUDA graph.

    block_tables:   [n, max_blocks] int32   the live requests' block tables
    seq_lens:       [n] int32               KV length after this step (the new token included)
    page_table_out: [bs, max_pages] int32   mutated; block b -> pages b*r .. b*r+r-1, null block -> 0,
                                            rows >= n -> 0
    seq_lens_out:   [bs] int32              mutated; rows >= n -> 0
    write_loc_out:  [bs * N] int64          mutated; row i * N + j: slot of position seq_len_i - N + j
                                            (clamped at 0; padded rows -> 0)
    width:          N, the verify window's query rows per request (1: plain decode)
"""

from __future__ import annotations

import triton
import triton.language as tl

from tscompile.custom_ops.metadata import register_refresh_impl

_BLOCK_ROWS = 16  # requests per program
_BLOCK_COLS = 128  # page-table columns per inner step


# n and bs change with the batch; specialising on them (n == 1, n % 16 == 0) would only add compiles.
@triton.jit(do_not_specialize=["n", "bs"])
def _refresh_kernel(
    block_tables_ptr, seq_lens_ptr, page_table_out_ptr, seq_lens_out_ptr, write_loc_out_ptr,
    stride_btr, stride_btc, stride_ptr, stride_ptc,
    n, bs, pages_per_block, page_size, max_pages, max_blocks,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, WIDTH: tl.constexpr,
):
    """Grid (cdiv(bs, BLOCK_ROWS),): each program rewrites BLOCK_ROWS requests of all three outputs
    (WIDTH write slots per request)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_out = rows < bs  # rows that exist in the outputs
    live = rows < n  # rows backed by a live request; the rest are padding
    bt_rows = block_tables_ptr + rows.to(tl.int64) * stride_btr  # [BLOCK_ROWS] row starts

    seq = tl.load(seq_lens_ptr + rows, mask=live, other=0)
    tl.store(seq_lens_out_ptr + rows, seq.to(seq_lens_out_ptr.dtype.element_ty), mask=in_out)

    # Page table: column c is page c % r of block column c // r; a null (0) block and columns past
    # the block table map to the null page 0, as expand_block_table does.
    for c0 in range(0, max_pages, BLOCK_COLS):
        cols = c0 + tl.arange(0, BLOCK_COLS)
        bcol = cols // pages_per_block
        has_block = live[:, None] & (bcol < max_blocks)[None, :]
        block = tl.load(bt_rows[:, None] + bcol[None, :] * stride_btc, mask=has_block, other=0)
        page = tl.where(block > 0, block * pages_per_block + (cols % pages_per_block)[None, :], 0)
        tl.store(page_table_out_ptr + rows.to(tl.int64)[:, None] * stride_ptr + cols[None, :] * stride_ptc,
                 page.to(page_table_out_ptr.dtype.element_ty),
                 mask=in_out[:, None] & (cols < max_pages)[None, :])

    # Write slots of the window's WIDTH tokens, straight from the block table (same expansion rule).
    for j in range(WIDTH):
        pos = tl.maximum(seq - WIDTH + j, 0)
        pcol = pos // page_size
        bcol = pcol // pages_per_block
        has_block = live & (bcol < max_blocks) & (pcol < max_pages)
        block = tl.load(bt_rows + bcol * stride_btc, mask=has_block, other=0)
        page = tl.where(block > 0, block * pages_per_block + pcol % pages_per_block, 0).to(tl.int64)
        slot = tl.where(live, page * page_size + pos % page_size, 0)
        tl.store(write_loc_out_ptr + rows.to(tl.int64) * WIDTH + j, slot.to(write_loc_out_ptr.dtype.element_ty),
                 mask=in_out)


def triton_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block,
                   page_size, width: int = 1) -> None:
    """Same contract and results as ``torch_refresh``, in one launch."""
    bs, max_pages = page_table_out.shape
    if bs == 0:
        return
    n = seq_lens.shape[0]
    _refresh_kernel[(triton.cdiv(bs, _BLOCK_ROWS),)](
        block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out,
        block_tables.stride(0), block_tables.stride(1), page_table_out.stride(0), page_table_out.stride(1),
        n, bs, pages_per_block, page_size, max_pages, block_tables.shape[1],
        BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, WIDTH=width,
    )


register_refresh_impl("triton", triton_refresh)
