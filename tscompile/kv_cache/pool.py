"""The paged KV storage and its block allocator.

``KVCachePool`` owns the tensors: per cache group, per layer, ``k`` and ``v`` of shape
``[num_pages, page_size, num_kv_heads, head_dim]``. ``BlockAllocator`` hands out block ids; block 0
(pages ``0 .. pages_per_block - 1``) is the null block, reserved at construction and never handed
out, so padded requests and empty table entries can point at it without touching a live request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tscompile.kv_cache.spec import CacheGeometry, CacheGroupSpec


class BlockAllocator:
    """Free-list of block ids ``1 .. num_blocks - 1`` (block 0 is the reserved null block)."""

    def __init__(self, num_blocks: int, group_name: str = "full"):
        if num_blocks < 2:
            raise ValueError(f"tscompile: a cache group needs at least 2 blocks (1 reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.group_name = group_name
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(
                f"tscompile: page pool exhausted in cache group {self.group_name!r}: need {n} blocks, "
                f"{len(self._free)} free of {self.num_blocks - 1}; raise num_pages or lower max_num_seqs"
            )
        # the ids ``n`` pops would give, in their order, as one slice (a prompt takes many blocks)
        at = len(self._free) - n
        blocks = self._free[at:]
        blocks.reverse()
        del self._free[at:]
        return blocks

    def free(self, blocks: list[int]) -> None:
        # min and max run in C; the message's loop runs only on a failure
        assert not blocks or (0 < min(blocks) and max(blocks) < self.num_blocks), \
            f"freeing block {next(b for b in blocks if not 0 < b < self.num_blocks)} outside the pool"
        self._free.extend(reversed(blocks))


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
