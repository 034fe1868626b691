"""Automatic prefix caching: full KV blocks named by a chained hash, reused by later requests.

A sequence's block ``k`` (tokens ``k * B .. (k + 1) * B - 1``, ``B`` the block size) is named by
``hash((hash of block k - 1, its token ids, extra_key))``; block 0's parent is a random root drawn
per cache, and ``extra_key`` is whatever else changes the KV of the same tokens (a LoRA or a
multimodal key later; None now). Only full blocks are hashed, each once, as its tokens become known
(``BlockChain``); a block is published to the allocator's cache only once its KV is final
(``PrefixCache.publish``: the caller says how many tokens are final, which a speculative verify step
would set to the accepted ones, never to drafts).

A new or preempted request looks up its longest cached run of full blocks (``PrefixCache.match``),
capped so that at least its last token is computed (a fully cached prompt still yields logits), and
its remaining tokens run as an ordinary extend with that prefix. The built-in hash is cheap and not
collision resistant; the allocator checks tokens and parents on a match, so a collision only misses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Hashable

from tscompile.kv_cache.allocator import ROOT_SERIAL, BlockAllocator

TokensOf = Callable[[int, int], list[int]]  # (start, stop) -> the sequence's token ids in [start, stop)


def block_hash(parent: int, tokens: tuple[int, ...], extra_key: Hashable = None) -> int:
    """The chain hash of one full block after the block hashed ``parent``."""
    return hash((parent, tokens, extra_key))


class BlockChain:
    """One sequence's full blocks: their chain hashes and token ids (computed once each, in order),
    and how far the cache knows the sequence (``num_cached`` blocks matched or published, the last of
    serial ``serial``)."""

    __slots__ = ("root", "block_size", "extra_key", "hashes", "tokens", "num_cached", "serial", "broken")

    def __init__(self, root: int, block_size: int, extra_key: Hashable = None):
        self.root, self.block_size, self.extra_key = root, block_size, extra_key
        self.hashes: list[int] = []
        self.tokens: list[tuple[int, ...]] = []
        self.num_cached = 0
        self.serial = ROOT_SERIAL
        self.broken = False  # a hash collision with another sequence: this one is not cached further

    def extend(self, tokens_of: TokensOf, num_blocks: int) -> None:
        """Hash blocks up to ``num_blocks`` (each full: its tokens known)."""
        have = len(self.hashes)
        if num_blocks <= have:
            return
        size = self.block_size
        ids = tokens_of(have * size, num_blocks * size)  # one slice, then one tuple per block
        parent = self.hashes[-1] if self.hashes else self.root
        extra = self.extra_key
        for at in range(0, len(ids), size):
            toks = tuple(ids[at: at + size])
            parent = hash((parent, toks, extra))
            self.hashes.append(parent)
            self.tokens.append(toks)

    def rewind(self) -> None:
        """The sequence's blocks were released: what the cache holds of it is unknown again."""
        self.num_cached, self.serial = 0, ROOT_SERIAL


@dataclass
class PrefixCacheStats:
    """Counters since the engine started: ``queries`` tokens looked up (each admitted request's
    prompt, again after a preemption), ``hits`` of them found cached. Read two snapshots for the hit
    rate of an interval."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """The scheduler's view of the cache over one allocator: chains, lookups, publication, counters,
    and which blocks running prefills are computing now (a request that would reuse them waits)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, seed: int | None = None):
        self.allocator = allocator
        self.block_size = block_size
        self.root = random.Random(seed).getrandbits(63)
        self.stats = PrefixCacheStats()
        self._computing: dict[int, int] = {}  # hash -> running prefills whose next block to publish it is

    def new_chain(self, extra_key: Hashable = None) -> BlockChain:
        return BlockChain(self.root, self.block_size, extra_key)

    def match(self, chain: BlockChain, tokens_of: TokensOf, num_tokens: int) -> list[int]:
        """The cached blocks of the first ``num_tokens`` tokens' longest cached run of full blocks,
        leaving at least the last of them to compute (not held yet: ``acquire`` them). Hashes only the
        blocks it looks up, up to and including the first miss."""
        limit = (num_tokens - 1) // self.block_size
        blocks: list[int] = []
        serial = ROOT_SERIAL
        step = 4  # hash a few blocks, then more: a miss (the common case) hashes few
        while len(blocks) < limit:
            start = len(blocks)
            upto = min(start + step, limit)
            chain.extend(tokens_of, upto)
            found, serial = self.allocator.match(chain.hashes[start:upto], chain.tokens[start:upto], serial)
            blocks += found
            if len(blocks) < upto:
                break
            step *= 4
        chain.num_cached, chain.serial = len(blocks), serial
        return blocks

    def would_wait(self, chain: BlockChain, num_tokens: int) -> bool:
        """Whether the block after a request's hit (of its first ``num_tokens`` tokens' candidates) is
        one a running prefill computes now: admitted after that step, the request reuses it."""
        k = chain.num_cached
        return bool(self._computing) and (k + 1) * self.block_size <= num_tokens - 1 and k < len(chain.hashes) \
            and chain.hashes[k] in self._computing

    def count(self, queried: int, hit: int) -> None:
        self.stats.queries += queried
        self.stats.hits += hit

    def publish(self, chain: BlockChain, blocks: list[int], tokens_of: TokensOf, num_final: int) -> None:
        """Cache the sequence's full blocks among its first ``num_final`` tokens (those whose KV is
        final and whose ids are known) that the cache does not know yet; ``blocks`` are the
        sequence's block ids in order."""
        full = min(num_final // self.block_size, len(blocks))
        if full <= chain.num_cached or chain.broken:
            return
        chain.extend(tokens_of, full)
        alloc, serial = self.allocator, chain.serial
        for k in range(chain.num_cached, full):
            serial = alloc.cache(blocks[k], chain.hashes[k], chain.tokens[k], serial)
            if serial is None:
                chain.broken = True
                return
            chain.num_cached, chain.serial = k + 1, serial

    # -- blocks running prefills compute -----------------------------------------------------------
    def mark_computing(self, chain: BlockChain, tokens_of: TokensOf, num_prefill: int) -> int | None:
        """Register the next block a prefill will publish (if it is a full block of its first
        ``num_prefill`` tokens); returns its hash, to ``unmark`` later."""
        k = chain.num_cached
        if (k + 1) * self.block_size > num_prefill or chain.broken:
            return None
        chain.extend(tokens_of, k + 1)
        h = chain.hashes[k]
        self._computing[h] = self._computing.get(h, 0) + 1
        return h

    def unmark(self, h: int | None) -> None:
        if h is None:
            return
        n = self._computing[h] - 1
        if n:
            self._computing[h] = n
        else:
            del self._computing[h]
