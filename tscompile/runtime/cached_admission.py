"""The scheduler's prefix caching: admitting a request over its cached blocks, publishing its full
blocks as their KV becomes final, and letting go of them (``kv_cache/prefix_cache.py`` hashes and
looks up; the allocator holds and evicts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tscompile.kv_cache.prefix_cache import PrefixCache, PrefixCacheStats

if TYPE_CHECKING:
    from tscompile.runtime.scheduler import Request

NEVER = 1 << 62  # a request's publish_at without prefix caching: no token count reaches it


class CachedAdmission:
    """Prefix caching for a scheduler of one cache group."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.allocator = cache.allocator
        self.block_size = cache.block_size

    @property
    def stats(self) -> PrefixCacheStats:
        return self.cache.stats

    def admit(self, req: Request, need: int, free_slots: list[int]) -> bool:
        """Give ``req`` (not running) a slot, its longest cached run of full blocks (shared) and
        fresh blocks up to ``need``, and start it after the cached tokens; False (nothing changed)
        when the pool is short, or when the block after the hit is one a running prefill computes
        now (admitted after that step, the request reuses it)."""
        cache, alloc = self.cache, self.allocator
        if req.chain is None:
            req.chain = cache.new_chain()
        hit = cache.match(req.chain, req.prefill_tokens, req.prefill_len)
        if cache.would_wait(req.chain, req.prefill_len):
            return False
        unheld = sum(1 for b in hit if alloc.ref_count(b) == 0)  # these leave num_free once shared
        if alloc.num_free - unheld < need - len(hit):
            return False
        req.slot = free_slots.pop()
        alloc.share(hit)
        req.blocks = [hit + alloc.allocate(need - len(hit))]
        cached = len(hit) * self.block_size
        cache.count(req.prefill_len, cached)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        req.num_computed = cached
        req.group_lens = [cached]
        req.publish_at = (len(hit) + 1) * self.block_size
        self._mark_computing(req)
        return True

    def publish(self, r: Request) -> None:
        """Publish ``r``'s full blocks whose KV is final (computed, and every token id known on the
        host: a decode row's input may still be on the device), and register the next block its
        prefill computes."""
        chain = r.chain
        final = min(r.num_computed, len(r.prompt) + len(r.output))
        self.cache.publish(chain, r.blocks[0], r.prefill_tokens, final)
        r.publish_at = NEVER if chain.broken else (chain.num_cached + 1) * self.block_size
        self._mark_computing(r)

    def _mark_computing(self, r: Request) -> None:
        cache = self.cache
        cache.unmark(r.computing)
        r.computing = None
        if r.num_computed < r.prefill_len:
            r.computing = cache.mark_computing(r.chain, r.prefill_tokens, r.prefill_len)

    def release(self, r: Request) -> None:
        """Before ``r``'s blocks are freed: publish what became final since the last update (a stop
        read back), and forget where it stands in the cache."""
        if r.chain is None:
            return
        if r.num_computed >= r.publish_at:
            self.publish(r)
        self.cache.unmark(r.computing)
        r.computing, r.publish_at = None, NEVER
        r.chain.rewind()

    def reset(self, running: list[Request]) -> None:
        """Forget every cached block; the running requests stop publishing (their chains name
        serials that are gone)."""
        self.allocator.reset_cache()
        for r in running:
            if r.chain is not None:
                r.chain.broken = True
                r.publish_at = NEVER
