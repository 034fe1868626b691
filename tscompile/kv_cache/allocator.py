"""The block allocator: reference-counted block ids, and the cached blocks a prefix hit reuses.

Block 0 (pages ``0 .. pages_per_block - 1``) is the null block, reserved at construction and never
handed out or cached, so padded requests and empty table entries can point at it without touching a
live request.

A block is in one of three states:

- in use: held by one or more requests (its reference count);
- free: held by none, its content worthless, on a stack;
- cached and free: held by none, but its KV is a full block of some prefix that a later request may
  reuse (``match``). These wait in least-recently-released order and are evicted, oldest first, only
  when an allocation finds the free stack empty.

``num_free`` counts both kinds of unheld block: each can be handed out now. Every structure here is
O(1) per block: a list stack, an ``OrderedDict`` (a doubly linked list in C) for the cached ones, and
a dict from block hash to block.

A cached block records its chain hash (``tscompile.kv_cache.prefix_cache``), its token ids and a
serial number unique for the allocator's lifetime, with its parent's serial. A match checks the
tokens and that each block's recorded parent is the block matched before it, so a hash collision
(the built-in hash is not collision resistant) can only miss, never hand out another prefix's KV,
and a block whose parent was evicted (and its id reused) is never reached through a new parent.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ROOT_SERIAL = 0  # the parent serial of a sequence's first block


@dataclass(slots=True)
class CachedBlock:
    block_hash: int
    tokens: tuple[int, ...]
    serial: int
    parent_serial: int


class BlockAllocator:
    """Reference-counted block ids ``1 .. num_blocks - 1`` (block 0 is the reserved null block), with
    the cache of full blocks a prefix hit reuses."""

    def __init__(self, num_blocks: int, group_name: str = "full"):
        if num_blocks < 2:
            raise ValueError(f"tscompile: a cache group needs at least 2 blocks (1 reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.group_name = group_name
        self._free = list(range(num_blocks - 1, 0, -1))  # uncached and unheld; pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unheld, least recently released first
        self._refs = [0] * num_blocks
        self._entries: list[CachedBlock | None] = [None] * num_blocks  # block -> what it caches
        self._by_hash: dict[int, int] = {}  # chain hash -> block
        self._serials = ROOT_SERIAL
        self.num_evictions = 0

    # -- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: the free ones and the cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose KV is in the cache (held or not)."""
        return len(self._by_hash)

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """Every unheld block id (free or cached), sorted: a drained engine has them all."""
        return sorted([*self._free, *self._evictable])

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each held once: free ones first, then the least recently released cached
        ones (evicted from the cache)."""
        if n > self.num_free:
            raise ValueError(
                f"tscompile: page pool exhausted in cache group {self.group_name!r}: need {n} blocks, "
                f"{self.num_free} free of {self.num_blocks - 1}; raise num_pages or lower max_num_seqs"
            )
        # the ids ``n`` pops would give, in their order, as one slice (a prompt takes many blocks)
        take = min(n, len(self._free))
        at = len(self._free) - take
        blocks = self._free[at:]
        blocks.reverse()
        del self._free[at:]
        for _ in range(n - take):
            block, _ = self._evictable.popitem(last=False)
            self._evict(block)
            blocks.append(block)
        refs = self._refs
        for b in blocks:
            refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Hold ``blocks`` (cached blocks a prefix hit reuses) once more each."""
        refs, evictable = self._refs, self._evictable
        for b in blocks:
            if refs[b] == 0:
                del evictable[b]
            refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one hold of each of ``blocks``. A block nobody holds becomes free, or, cached, the most
        recently released cached block; the last of ``blocks`` is released first, so a sequence's
        tail is evicted before its head (which more sequences share)."""
        # min and max run in C; the message's loop runs only on a failure
        assert not blocks or (0 < min(blocks) and max(blocks) < self.num_blocks), \
            f"freeing block {next(b for b in blocks if not 0 < b < self.num_blocks)} outside the pool"
        refs, entries = self._refs, self._entries
        for b in reversed(blocks):
            refs[b] -= 1
            assert refs[b] >= 0, f"block {b} freed more often than it was held"
            if refs[b] == 0:
                if entries[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    # -- the cache -------------------------------------------------------------------------------
    def match(self, hashes: list[int], tokens: list[tuple[int, ...]],
              parent_serial: int = ROOT_SERIAL) -> tuple[list[int], int]:
        """The longest run of cached blocks holding consecutive full blocks of chain hashes ``hashes``
        and token ids ``tokens``, the first after the cached block of serial ``parent_serial``; and
        the serial of the run's last block (``parent_serial`` for none). Nothing is held: ``share``
        the blocks to keep them."""
        blocks: list[int] = []
        serial = parent_serial
        by_hash, entries = self._by_hash, self._entries
        for h, toks in zip(hashes, tokens):
            b = by_hash.get(h)
            if b is None:
                break
            entry = entries[b]
            if entry.parent_serial != serial or entry.tokens != toks:
                break  # a hash collision, or a child whose parent was evicted: a miss
            blocks.append(b)
            serial = entry.serial
        return blocks, serial

    def cache(self, block: int, block_hash: int, tokens: tuple[int, ...], parent_serial: int) -> int | None:
        """Record that held ``block`` holds the full block ``tokens`` after the cached block of serial
        ``parent_serial``. Returns the serial a next block names as its parent: this block's, or that
        of an identical block cached earlier (kept as it is, ``block`` stays uncached: no dedup, so
        block tables only grow); None when another sequence's block has the same hash (a collision:
        the caller stops caching that sequence)."""
        assert block != 0 and self._refs[block] > 0, f"caching block {block}, which no request holds"
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            entry = self._entries[existing]
            same = entry.parent_serial == parent_serial and entry.tokens == tokens
            return entry.serial if same else None
        if self._entries[block] is not None:
            return None  # already caches another block of some sequence (never happens for a fresh block)
        self._serials += 1
        self._entries[block] = CachedBlock(block_hash, tokens, self._serials, parent_serial)
        self._by_hash[block_hash] = block
        return self._serials

    def _evict(self, block: int) -> None:
        entry = self._entries[block]
        self._entries[block] = None
        if self._by_hash.get(entry.block_hash) == block:
            del self._by_hash[entry.block_hash]
        self.num_evictions += 1

    def reset_cache(self) -> None:
        """Forget every cached block: the unheld ones become free, held ones stay with their holders."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._by_hash.clear()
        self._entries = [None] * self.num_blocks

    def check(self) -> None:
        """Assert the bookkeeping is whole: every block but the null one is held, free or cached and
        free, exactly once; the hash map and the entries agree."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free stack twice"
        assert not free & evictable, "a block is both free and cached-free"
        assert 0 not in free and 0 not in evictable and self._refs[0] == 0 and self._entries[0] is None
        for b in range(1, self.num_blocks):
            held = self._refs[b] > 0
            assert held + (b in free) + (b in evictable) == 1, f"block {b}: refs {self._refs[b]}, not in exactly one state"
            assert (b in evictable) <= (self._entries[b] is not None), f"cached-free block {b} has no entry"
            assert (b in free) <= (self._entries[b] is None), f"free block {b} still has an entry"
        for h, b in self._by_hash.items():
            assert self._entries[b] is not None and self._entries[b].block_hash == h
        assert sum(e is not None for e in self._entries) == len(self._by_hash)
