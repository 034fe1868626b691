"""Write-location math as pure functions: the one place ``slot = table[req, pos // P] * P + pos % P``
is written down. Everything else (the refresh op, the extend planner, tests) calls these.

A *block table* is the scheduler's: ``[num_reqs, max_blocks]`` block ids of ``block_size`` tokens.
A *page table* is the kernels': ``[num_reqs, max_pages]`` page ids of ``page_size`` tokens. One block
is ``pages_per_block`` consecutive pages: block ``b`` holds pages ``b * r .. b * r + r - 1``. Block 0
and page 0 are the reserved null entries, so an empty table entry maps to page 0, never to a live one.
"""

from __future__ import annotations

import numpy as np
import torch


def expand_block_table(block_table: torch.Tensor, pages_per_block: int, max_pages: int) -> torch.Tensor:
    """``[n, max_blocks]`` block ids -> ``[n, max_pages]`` page ids (int32); null block -> page 0."""
    cols = torch.arange(max_pages, device=block_table.device)
    block_col = torch.clamp(cols // pages_per_block, max=block_table.shape[1] - 1)
    blocks = block_table.long().index_select(1, block_col)
    pages = blocks * pages_per_block + (cols % pages_per_block)
    in_range = (cols // pages_per_block) < block_table.shape[1]
    return torch.where((blocks > 0) & in_range, pages, 0).to(torch.int32)


def expand_block_table_rows(block_table: np.ndarray, pages_per_block: int, max_pages: int) -> np.ndarray:
    """The host (numpy) form of ``expand_block_table``: ``[n, max_blocks]`` block ids -> ``[n,
    max_pages]`` page ids (int32), null block -> page 0. Built on the host so a prefill step uploads
    its page tables instead of launching the expansion on the device."""
    cols = np.arange(max_pages)
    in_range = (cols // pages_per_block) < block_table.shape[1]
    block_col = np.minimum(cols // pages_per_block, block_table.shape[1] - 1)
    blocks = block_table[:, block_col].astype(np.int64)
    pages = blocks * pages_per_block + cols % pages_per_block
    return np.where((blocks > 0) & in_range, pages, 0).astype(np.int32)


def slot_from_page_table(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of token ``positions[i]`` of request ``i``: ``page_table[i, pos // P] * P + pos % P``."""
    page = page_table.long().gather(1, (positions.long() // page_size)[:, None])[:, 0]
    return page * page_size + positions.long() % page_size


def slot_from_block_table(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same slot computed straight from the scheduler's table (used to check the router)."""
    block = block_table.long().gather(1, (positions.long() // block_size)[:, None])[:, 0]
    return block * block_size + positions.long() % block_size


def slot_from_block_rows(block_tables: np.ndarray, req: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """The host (numpy) form of ``slot_from_block_table`` for many rows per request: row ``i`` is
    request ``req[i]``'s token at ``positions[i]``. It indexes the table in place (no per-row copy of
    a table row), so a 2048-token step costs microseconds. Returns int64 slots."""
    blocks = block_tables[req, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


_BLOCK_OFFSETS: dict[int, np.ndarray] = {}


def slots_of_run(block_row: np.ndarray, first: int, rows: int, block_size: int) -> np.ndarray:
    """The slots of one request's consecutive positions ``first .. first + rows - 1`` (``block_row``:
    its ``[max_blocks]`` table row), int64: what ``slot_from_block_rows`` gives those rows, built from
    the blocks they span (each block's ``block_size`` slots, then one slice) instead of a per-row
    gather, which at a prefill's few hundred rows costs several times these three numpy calls."""
    offsets = _BLOCK_OFFSETS.get(block_size)
    if offsets is None:
        offsets = _BLOCK_OFFSETS[block_size] = np.arange(block_size, dtype=np.int64)
        offsets.setflags(write=False)
    start_block = first // block_size
    end_block = -(-(first + rows) // block_size)
    if rows <= 0 or end_block > block_row.shape[0]:  # nothing to place, or past the table: the gather's answer
        positions = np.arange(first, first + max(rows, 0), dtype=np.int64)
        return slot_from_block_rows(block_row[None], 0, positions, block_size)
    # int64 before multiplying (block ids times the block size may pass int32)
    slots = (np.multiply(block_row[start_block:end_block, None], block_size, dtype=np.int64) + offsets).reshape(-1)
    skip = first - start_block * block_size
    return slots[skip: skip + rows]
