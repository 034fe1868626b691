"""What a model declares about its KV cache: one spec per cache group."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CacheGroupSpec:
    """One cache group: the layers that share a page-id space and a per-request sequence.

    ``window`` is None for a group that keeps every position; for the narrowing model's tail group
    it is the number of rows a prompt-completing chunk keeps (see ``kept_rows``).
    """

    name: str
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    @property
    def narrowed(self) -> bool:
        return self.window is not None


def kept_rows(q_lens, completes, window: int | None):
    """Rows of each chunk a group keeps: the host twin of ``tscompile::narrow_rows``'s device rule
    (``custom_ops/narrow.py``). ``q_lens`` and ``completes`` are ints/bools or equal-length arrays;
    a prompt-completing chunk keeps its last ``min(window, q_len)`` rows, any other its last row."""
    if window is None:
        return q_lens
    return np.where(completes, np.minimum(q_lens, window), np.minimum(q_lens, 1))


def kept_row_count(q_len: int, completes: bool, window: int) -> int:
    """``kept_rows`` of one chunk in plain Python: a step plan takes it per request, where a numpy
    call per request would cost more than the rule."""
    return min(q_len, window) if completes else min(q_len, 1)


@dataclass(frozen=True)
class CacheGeometry:
    """The storage geometry of one group in a pool; a rebind may change ``num_pages`` only."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_block: int
    dtype: torch.dtype
    layer_ids: tuple[int, ...]

    @property
    def block_size(self) -> int:
        return self.page_size * self.pages_per_block
