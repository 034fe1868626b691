"""FlashInfer's host-side facts, without importing flashinfer (so they are tested on any machine):
its view of the paged cache, the geometry its kernels serve and the refusal where it cannot run.

FlashInfer does not read a page table. It reads a CSR layout over pages: request ``b``'s pages are
``indices[indptr[b]:indptr[b + 1]]`` and its last page holds ``last_page_len[b]`` (1 to page_size)
tokens, so its KV length is ``(pages - 1) * page_size + last_page_len``. ``paged_kv_arrays`` turns
the scheduler's block tables and the KV lengths into that layout, with the page ids the torch
backend's page table holds (``kv_cache/slots.py``: block ``k`` is pages ``k * r .. k * r + r - 1``).

FlashInfer needs at least one KV entry per request, so a row with nothing to attend (a padded
decode row, or a request of a narrowed group with no KV yet) reads the null page 0 with length 1.
Nothing reads such a row's output; the null page's slot 0 is where padded rows write their K/V.
"""

from __future__ import annotations

import numpy as np
import torch

from tscompile.kv_cache.slots import expand_block_table_rows

# FlashInfer's CUDA-core decode kernel is instantiated for these query heads per KV head only
DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer has no float32 attention kernels

FLASHINFER_NEEDS = ("tscompile: attention_backend='flashinfer' needs flashinfer-python "
                    "(pip install 'tscompile[flashinfer]') and a CUDA device")


def paged_kv_arrays(block_tables: np.ndarray, seq_lens: np.ndarray, *, page_size: int, pages_per_block: int,
                    num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr [R + 1], indices [indptr[R]], last_page_len [R])``, int32, for ``R = num_rows``
    rows (default: one per request). ``block_tables``: ``[n, max_blocks]`` block ids; ``seq_lens``:
    ``[n]`` KV lengths (after this step's writes). Rows ``[n, R)`` are padding; they and any row of
    length 0 get the null page 0 with length 1."""
    n = seq_lens.shape[0]
    rows = n if num_rows is None else num_rows
    if rows < n:
        raise ValueError(f"tscompile: {n} live rows do not fit in {rows} rows")
    lens = seq_lens.astype(np.int64)
    live_pages = -(-lens // page_size)  # 0 for an empty row
    pages_per_row = np.ones(rows, dtype=np.int64)
    pages_per_row[:n] = np.maximum(live_pages, 1)
    indptr = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(pages_per_row, out=indptr[1:])
    last_page_len = np.ones(rows, dtype=np.int32)
    last_page_len[:n] = np.where(lens > 0, lens - (live_pages - 1) * page_size, 1)
    # only the columns some row uses: a long max_model_len must not cost every step a full table
    width = int(max(live_pages.max(initial=0), 1))
    pages = expand_block_table_rows(block_tables[:n], pages_per_block, width)
    pages[lens == 0, 0] = 0
    used = np.arange(width)[None, :] < np.maximum(live_pages, 1)[:, None]
    indices = np.zeros(int(indptr[-1]), dtype=np.int32)  # padded rows keep their zero: the null page
    indices[: int(indptr[n])] = pages[used]  # row-major: each row's pages in order, rows in order
    return indptr, indices, last_page_len


def flashinfer_geometry_problem(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                dtype: torch.dtype) -> str | None:
    """Why FlashInfer's kernels cannot serve this cache group (a sentence), or None."""
    if dtype not in DTYPES:
        return f"a bfloat16 or float16 KV cache (FlashInfer has no {dtype} kernels); got dtype {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim in {HEAD_DIMS}; got head_dim {head_dim}"
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads not in DECODE_GROUP_SIZES:
        return (f"query heads per KV head in {DECODE_GROUP_SIZES} (its CUDA-core decode kernel); got "
                f"{num_q_heads} query heads over {num_kv_heads} KV heads")
    return None
