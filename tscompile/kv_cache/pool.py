"""The paged KV storage.

``KVCachePool`` owns the tensors: per cache group, per layer, ``k`` and ``v`` of shape
``[num_pages, page_size, num_kv_heads, head_dim]``. ``BlockAllocator`` (``allocator.py``, imported
here too) hands out block ids; block 0 (pages ``0 .. pages_per_block - 1``) is the null block,
reserved at construction and never handed out, so padded requests and empty table entries can point
at it without touching a live request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tscompile.kv_cache.allocator import BlockAllocator
from tscompile.kv_cache.spec import CacheGeometry, CacheGroupSpec

__all__ = ["BlockAllocator", "GroupStorage", "KVCachePool"]


@dataclass
class GroupStorage:
    geometry: CacheGeometry
    num_pages: int
    k: dict[int, torch.Tensor]  # layer id -> [num_pages, page_size, num_kv_heads, head_dim]
    v: dict[int, torch.Tensor]


class KVCachePool:
    """KV tensors for every cache group of a model, allocated once."""

    def __init__(self, groups: dict[int, GroupStorage]):
        self.groups = groups

    @classmethod
    def allocate(
        cls,
        specs: list[CacheGroupSpec],
        num_pages: list[int],
        *,
        page_size: int,
        pages_per_block: int = 1,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "KVCachePool":
        groups = {}
        for gid, (spec, n) in enumerate(zip(specs, num_pages)):
            if n % pages_per_block:
                raise ValueError(f"tscompile: num_pages {n} is not a multiple of pages_per_block {pages_per_block}")
            geo = CacheGeometry(spec.num_kv_heads, spec.head_dim, page_size, pages_per_block, dtype, spec.layer_ids)
            shape = (n, page_size, spec.num_kv_heads, spec.head_dim)
            k = {lid: torch.empty(shape, dtype=dtype, device=device) for lid in spec.layer_ids}
            v = {lid: torch.empty(shape, dtype=dtype, device=device) for lid in spec.layer_ids}
            groups[gid] = GroupStorage(geo, n, k, v)
        return cls(groups)

    @staticmethod
    def page_bytes(specs: list[CacheGroupSpec], page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page in every cache group together: K and V of each layer, ``page_size``
        rows of ``num_kv_heads * head_dim`` (every group holds the same number of pages)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(2 * len(s.layer_ids) * page_size * s.num_kv_heads * s.head_dim * itemsize for s in specs)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for g in self.groups.values() for t in [*g.k.values(), *g.v.values()])

    def release(self) -> None:
        """Free every page's storage now, even where a model or backend still holds the tensors
        (the profiling pool of ``build.py``, whose holders are rebound to the real pool later)."""
        for g in self.groups.values():
            for t in [*g.k.values(), *g.v.values()]:
                t.untyped_storage().resize_(0)

    def geometry(self, gid: int) -> CacheGeometry:
        return self.groups[gid].geometry

    def num_blocks(self, gid: int) -> int:
        g = self.groups[gid]
        return g.num_pages // g.geometry.pages_per_block

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        for g in self.groups.values():
            if layer_id in g.k:
                return g.k[layer_id], g.v[layer_id]
        raise KeyError(layer_id)

    def fill_(self, value: float) -> None:
        """Poison every page (tests use it to prove a page was or was not written)."""
        for g in self.groups.values():
            for t in [*g.k.values(), *g.v.values()]:
                t.fill_(value)
