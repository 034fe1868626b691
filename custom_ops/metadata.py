"""``tscompile::refresh_decode_metadata``: rewrite one cache group's persistent decode buffers in place.

The only way decode metadata is prepared. It never reads the host, so it runs the same eagerly,
before a graph replay, inside a captured graph or inside an exported program.

    block_tables:   [n, max_blocks] int32   the live requests' block tables (n = actual_bs)
    seq_lens:       [n] int32               KV length after this step (the new token included)
    page_table_out: [bs, max_pages] int32   mutated; rows >= n become the null page 0
    seq_lens_out:   [bs] int32              mutated; rows >= n become 0
    write_loc_out:  [bs] int64              mutated; slot of position seq_len - 1; padding -> slot 0
    impl:           which registered kernel runs ("torch", "triton", ...)
"""

from __future__ import annotations

from typing import Callable

import torch

from tscompile.kv_cache.slots import expand_block_table, slot_from_page_table

_IMPLS: dict[str, Callable[..., None]] = {}


def register_refresh_impl(name: str, fn: Callable[..., None]) -> None:
    """Make ``fn(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block,
    page_size)`` reachable as ``impl=name``."""
    _IMPLS[name] = fn


def run_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block: int,
                page_size: int, impl: str) -> None:
    """The op's body without the dispatcher: the runtime refreshes eagerly before every replay, and a
    custom-op call costs tens of microseconds of host work there."""
    fn = _IMPLS.get(impl)
    if fn is None:
        raise ValueError(f"tscompile: unknown refresh impl {impl!r}; known: {sorted(_IMPLS)}")
    fn(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size)


@torch.library.custom_op(
    "tscompile::refresh_decode_metadata", mutates_args=("page_table_out", "seq_lens_out", "write_loc_out")
)
def refresh_decode_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table_out: torch.Tensor,
    seq_lens_out: torch.Tensor,
    write_loc_out: torch.Tensor,
    pages_per_block: int,
    page_size: int,
    impl: str,
) -> None:
    run_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size, impl)


@refresh_decode_metadata.register_fake
def _(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size, impl):
    return None


def torch_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size):
    """Pure-torch refresh: a handful of small launches, no host reads."""
    n = seq_lens.shape[0]
    max_pages = page_table_out.shape[1]
    pages = expand_block_table(block_tables[:n], pages_per_block, max_pages)
    page_table_out[:n].copy_(pages)
    page_table_out[n:].zero_()
    seq_lens_out[:n].copy_(seq_lens)
    seq_lens_out[n:].zero_()
    positions = torch.clamp(seq_lens.long() - 1, min=0)
    write_loc_out[:n].copy_(slot_from_page_table(pages, positions, page_size))
    write_loc_out[n:].zero_()


register_refresh_impl("torch", torch_refresh)
