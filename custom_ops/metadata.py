"""``tscompile::refresh_decode_metadata``: rewrite one cache group's persistent decode buffers in place.

The only way decode metadata is prepared. It never reads the host, so it runs the same eagerly,
before a graph replay, inside a captured graph or inside an exported program.

A decode step is a verify window of ``width`` query rows per request (N; plain decode is N = 1).
Request i's window holds its positions ``seq_lens[i] - N .. seq_lens[i] - 1``: ``seq_lens`` is the
KV length after this step, the whole window included.

    block_tables:   [n, max_blocks] int32   the live requests' block tables (n = actual_bs)
    seq_lens:       [n] int32               KV length after this step (the N window rows included)
    page_table_out: [bs, max_pages] int32   mutated; rows >= n become the null page 0
    seq_lens_out:   [bs] int32              mutated; rows >= n become 0
    write_loc_out:  [bs * N] int64          mutated; row i * N + j: slot of position seq_len_i - N + j
                                            (clamped at 0); padding rows -> slot 0
    impl:           which registered kernel runs ("torch", "triton", ...)
    width:          N, the query rows per request (default 1: plain decode)
"""

from __future__ import annotations

from typing import Callable

import torch

from tscompile.kv_cache.slots import expand_block_table, slot_from_page_table

_IMPLS: dict[str, Callable[..., None]] = {}


def register_refresh_impl(name: str, fn: Callable[..., None]) -> None:
    """Make ``fn(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block,
    page_size, width)`` reachable as ``impl=name``."""
    _IMPLS[name] = fn


def check_window_shapes(page_table_out: torch.Tensor, write_loc_out: torch.Tensor, width: int) -> None:
    """Refuse a width the buffers do not hold: ``write_loc_out`` has ``bs * width`` rows. Shapes only
    (no host read of a tensor value), so the check is graph-safe."""
    if width < 1:
        raise ValueError(f"tscompile: refresh_decode_metadata width={width}; a verify window has at least 1 row "
                         "per request (1 is plain decode)")
    bs = page_table_out.shape[0]
    if write_loc_out.shape[0] != bs * width:
        raise ValueError(f"tscompile: refresh_decode_metadata write_loc_out has {write_loc_out.shape[0]} rows; a "
                         f"window of width {width} over {bs} requests needs {bs * width}; size it bs * width")


def run_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block: int,
                page_size: int, impl: str, width: int = 1) -> None:
    """The op's body without the dispatcher: the runtime refreshes eagerly before every replay, and a
    custom-op call costs tens of microseconds of host work there."""
    fn = _IMPLS.get(impl)
    if fn is None:
        raise ValueError(f"tscompile: unknown refresh impl {impl!r}; known: {sorted(_IMPLS)}")
    check_window_shapes(page_table_out, write_loc_out, width)
    fn(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size, width)


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
    width: int = 1,
) -> None:
    run_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size,
                impl, width)


@refresh_decode_metadata.register_fake
def _(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size, impl,
      width=1):
    check_window_shapes(page_table_out, write_loc_out, width)
    return None


def window_positions(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """``[n] int32`` KV lengths -> ``[n, width]`` int64 positions ``seq_len - width + j`` of each
    request's window (may be negative for a malformed length; callers clamp)."""
    return seq_lens.long()[:, None] - width + torch.arange(width, device=seq_lens.device)


def torch_refresh(block_tables, seq_lens, page_table_out, seq_lens_out, write_loc_out, pages_per_block, page_size,
                  width: int = 1):
    """Pure-torch refresh: a handful of small launches, no host reads."""
    n = seq_lens.shape[0]
    max_pages = page_table_out.shape[1]
    pages = expand_block_table(block_tables[:n], pages_per_block, max_pages)
    page_table_out[:n].copy_(pages)
    page_table_out[n:].zero_()
    seq_lens_out[:n].copy_(seq_lens)
    seq_lens_out[n:].zero_()
    # a position below 0 (a live length shorter than the window: the caller's bug) clamps to 0, as
    # plain decode always did for a zero length
    positions = window_positions(seq_lens, width).clamp(min=0).reshape(-1)  # [n * N]
    rows = pages if width == 1 else pages.repeat_interleave(width, dim=0)  # [n * N, max_pages]
    write_loc_out[: n * width].copy_(slot_from_page_table(rows, positions, page_size))
    write_loc_out[n * width:].zero_()


register_refresh_impl("torch", torch_refresh)
