"""Prefix caching: the hash chain, the allocator's cache and LRU, and engines whose greedy (and seeded)
tokens with caching on equal those with caching off, in float32, with every block accounted for."""

from __future__ import annotations

import random

import pytest
import torch

from fuzz_lib import assert_idle
from helpers import ids, small_llm
from tscompile import SamplingParams
from tscompile.kv_cache.allocator import ROOT_SERIAL, BlockAllocator
from tscompile.kv_cache.prefix_cache import BlockChain, PrefixCache, block_hash


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny engines: a second intra-op thread buys nothing on a busy machine (see test_fuzz.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the hash chain ----------------------------------------------------------------------------------
def _tokens_of(seq):
    return lambda start, stop: seq[start:stop]


def test_chain_hashes_are_the_chained_hash_of_each_full_block_and_grow_incrementally():
    rng = random.Random(1)
    seq = [rng.randrange(1000) for _ in range(37)]
    whole = BlockChain(root=12345, block_size=4)
    whole.extend(_tokens_of(seq), 9)
    parent, want = 12345, []
    for k in range(9):
        parent = block_hash(parent, tuple(seq[4 * k: 4 * k + 4]))
        want.append(parent)
    assert whole.hashes == want and whole.tokens == [tuple(seq[4 * k: 4 * k + 4]) for k in range(9)]
    step = BlockChain(root=12345, block_size=4)
    for n in (0, 1, 1, 4, 3, 9):  # any order of growth (and no shrinking) gives the same chain
        step.extend(_tokens_of(seq), n)
    assert step.hashes == want


def test_a_changed_token_changes_its_block_hash_and_every_later_one_and_no_earlier_one():
    rng = random.Random(2)
    seq = [rng.randrange(1000) for _ in range(32)]
    other = list(seq)
    other[13] += 1  # block 3 of 4-token blocks
    a, b = BlockChain(7, 4), BlockChain(7, 4)
    a.extend(_tokens_of(seq), 8)
    b.extend(_tokens_of(other), 8)
    assert a.hashes[:3] == b.hashes[:3]
    assert all(x != y for x, y in zip(a.hashes[3:], b.hashes[3:]))


def test_the_root_and_the_extra_key_change_every_hash():
    seq = list(range(16))
    base, rooted, keyed = BlockChain(1, 4), BlockChain(2, 4), BlockChain(1, 4, extra_key=("lora", 3))
    for c in (base, rooted, keyed):
        c.extend(_tokens_of(seq), 4)
    assert not set(base.hashes) & set(rooted.hashes) and not set(base.hashes) & set(keyed.hashes)


# -- the allocator's cache and LRU ---------------------------------------------------------------------
def _cache_run(alloc, blocks, hashes, tokens):
    serial = ROOT_SERIAL
    for b, h, t in zip(blocks, hashes, tokens):
        serial = alloc.cache(b, h, t, serial)
    return serial


def test_unheld_cached_blocks_stay_reusable_and_are_evicted_least_recently_released_first():
    alloc = BlockAllocator(9)  # blocks 1..8
    a, b = alloc.allocate(3), alloc.allocate(3)
    _cache_run(alloc, a, [101, 102, 103], [(1,), (2,), (3,)])
    _cache_run(alloc, b, [201, 202, 203], [(4,), (5,), (6,)])
    alloc.free(a)  # released tail first: a[2] is the least recently released
    alloc.free(b)
    alloc.check()
    assert alloc.num_free == 8 and alloc.num_cached == 6 and alloc.num_cached_free == 6
    got = alloc.allocate(2)  # the two uncached blocks first: nothing evicted
    assert alloc.num_cached == 6 and alloc.num_evictions == 0 and sorted(got) == sorted({1, 2, 3, 4, 5, 6, 7, 8} - {*a, *b})
    assert alloc.allocate(2) == [a[2], a[1]] and alloc.num_evictions == 2  # oldest first, a's tail before its head
    assert alloc.match([101, 102, 103], [(1,), (2,), (3,)])[0] == [a[0]]  # a's head is still cached
    alloc.check()
    found, _ = alloc.match([201, 202, 203], [(4,), (5,), (6,)])
    assert found == b
    alloc.share(found)  # held again: out of the LRU, no longer evictable
    assert alloc.num_free == 1 and all(alloc.ref_count(x) == 1 for x in b)
    assert sorted(alloc.allocate(1)) == [a[0]]  # the only unheld cached block left
    with pytest.raises(ValueError, match="tscompile: page pool exhausted .* need 1 blocks, 0 free of 8"):
        alloc.allocate(1)
    alloc.check()


def test_match_misses_on_a_collision_and_on_a_child_whose_parent_was_evicted():
    alloc = BlockAllocator(6)
    a = alloc.allocate(2)
    s1 = alloc.cache(a[0], 11, (1, 2), ROOT_SERIAL)
    alloc.cache(a[1], 12, (3, 4), s1)
    assert alloc.match([11, 12], [(1, 2), (3, 4)])[0] == a
    assert alloc.match([11, 12], [(1, 2), (3, 5)])[0] == [a[0]]  # same hash, other tokens: a miss
    assert alloc.cache(alloc.allocate(1)[0], 11, (9, 9), ROOT_SERIAL) is None  # a colliding block: not cached
    # the parent evicted, its id reused and cached again for the same tokens: the child, computed
    # over the old parent, is not reachable through the new one
    alloc.free([a[0]])
    assert a[0] in alloc.allocate(3)  # the two free blocks, then a[0], evicted
    assert alloc.match([11], [(1, 2)])[0] == []
    alloc.cache(a[0], 11, (1, 2), ROOT_SERIAL)
    assert alloc.match([11, 12], [(1, 2), (3, 4)])[0] == [a[0]]
    alloc.check()


def test_the_null_block_is_never_cached_and_an_unheld_block_cannot_be_cached():
    alloc = BlockAllocator(4)
    with pytest.raises(AssertionError):
        alloc.cache(0, 5, (1,), ROOT_SERIAL)
    with pytest.raises(AssertionError, match="which no request holds"):
        alloc.cache(2, 5, (1,), ROOT_SERIAL)


def test_only_final_tokens_are_published_and_a_lookup_leaves_the_last_token_to_compute():
    alloc = BlockAllocator(12)
    cache = PrefixCache(alloc, block_size=4, seed=0)
    seq = list(range(100, 120))  # five full blocks
    chain = cache.new_chain()
    blocks = alloc.allocate(5)
    cache.publish(chain, blocks, _tokens_of(seq), num_final=11)  # a verify step accepted 11 tokens
    assert chain.num_cached == 2 and alloc.num_cached == 2
    cache.publish(chain, blocks, _tokens_of(seq), num_final=20)
    assert chain.num_cached == 5 and alloc.num_cached == 5
    other = cache.new_chain()
    assert cache.match(other, _tokens_of(seq), 20) == blocks[:4]  # 20 tokens: the last block is computed
    assert cache.match(cache.new_chain(), _tokens_of(seq), 21) == blocks  # 21: every full block
    assert cache.match(cache.new_chain(), _tokens_of(seq[:9] + [0] * 11), 20) == blocks[:2]


# -- engines: caching on equals caching off -----------------------------------------------------------
def _engine(prefix: bool, **kw):
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("enforce_eager", True)
    kw.setdefault("max_model_len", 96)
    return small_llm(enable_prefix_caching=prefix, **kw)


def _workload(rng: random.Random, block: int, n: int):
    """Prompts over a few shared prefixes of random lengths (some exactly whole blocks, some one
    token off), each with a random tail (none for some: a prompt the cache holds whole), and
    ``max_new_tokens`` of several lengths, so requests finish while others share their blocks."""
    prefixes = []
    for _ in range(3):
        length = rng.choice([block * rng.randint(1, 6), block * rng.randint(1, 6) + rng.choice([-1, 1]),
                             rng.randint(1, 40)])
        prefixes.append([rng.randint(1, 400) for _ in range(max(length, 1))])
    prompts, params = [], []
    for _ in range(n):
        base = rng.choice(prefixes)
        tail = [rng.randint(1, 400) for _ in range(rng.choice([0, 1, rng.randint(1, 12)]))]
        prompts.append(base + tail)
        params.append(SamplingParams(max_new_tokens=rng.randint(1, 6)) if rng.random() < 0.7 else
                      SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=0.9, top_k=40,
                                     seed=rng.randrange(1000)))
    return prompts, params


@pytest.fixture(scope="module")
def engines():
    """Page sizes with whole-block and one-page-per-block layouts, and a pool so small that cached
    blocks are evicted and requests preempted; each engine once with caching and once without."""
    specs = {
        "page4": dict(page_size=4, max_num_seqs=4),
        "page2x2": dict(page_size=2, pages_per_block=2, max_num_seqs=4),
        "small_pool": dict(page_size=4, max_num_seqs=4, num_pages=30, max_num_batched_tokens=24),
    }
    return {name: (_engine(True, **kw), _engine(False, **kw)) for name, kw in specs.items()}


@pytest.mark.parametrize("name", ["page4", "page2x2", "small_pool"])
def test_random_shared_prefix_workloads_give_the_tokens_of_caching_off(engines, name):
    on, off = engines[name]
    block = on.scheduler.block_size
    rng = random.Random(name)
    hits = 0
    for round_ in range(3):  # the engines are reused: later rounds find earlier rounds' blocks
        prompts, params = _workload(rng, block, rng.randint(3, 6))
        before = on.stats()
        got = on.generate(prompts, params)
        want = off.generate(prompts, params)
        assert ids(got) == ids(want), f"{name} round {round_}"
        after = on.stats()
        hits += after.prefix_cache_hits - before.prefix_cache_hits
        assert sum(o.num_cached_tokens for o in got) <= after.prefix_cache_hits - before.prefix_cache_hits
        assert all(o.num_cached_tokens % block == 0 and o.num_cached_tokens < len(o.prompt_token_ids) for o in got)
        assert_idle(on, f"{name} round {round_} (caching on)")
        assert_idle(off, f"{name} round {round_} (caching off)")
    assert hits > 0 and not off.prefix_caching and off.stats().prefix_cache_queries == 0
    if name == "small_pool":
        assert on.scheduler.allocators[0].num_evictions > 0


def test_preemption_with_shared_blocks_gives_the_tokens_of_caching_off():
    """Requests that share a prefix grow in a pool too small for them: the most recently admitted is
    preempted (its shared blocks stay with the others), then recomputed from what is still cached."""
    rng = random.Random(5)
    shared = [rng.randint(1, 400) for _ in range(18)]
    prompts = [shared + [rng.randint(1, 400) for _ in range(rng.randint(0, 5))] for _ in range(5)]
    params = SamplingParams(max_new_tokens=14)
    want = ids(_engine(False, max_num_seqs=5, num_pages=20).generate(prompts, params))
    llm = _engine(True, max_num_seqs=5, num_pages=20)
    assert ids(llm.generate(prompts, params)) == want
    assert llm.scheduler.num_preemptions > 0 and llm.stats().prefix_cache_hits > 0
    assert_idle(llm, "preemption")


def test_requests_sharing_a_prefix_wait_for_the_first_to_compute_it():
    """Submitted together, one request computes the shared blocks; the others start after it with
    every shared full block cached (a whole-block prompt keeps its last block to compute)."""
    llm = _engine(True, max_num_seqs=4)
    shared = list(range(10, 30))  # 20 tokens: 5 blocks of 4
    outs = llm.generate([shared + [1, 2, 3], shared + [4], shared, shared + [5, 6]], SamplingParams(max_new_tokens=3))
    assert [o.num_cached_tokens for o in outs] == [0, 20, 16, 20]
    stats = llm.stats()
    assert stats.prefix_cache_hits == 56 and stats.prefix_cache_queries == 23 + 21 + 20 + 22
    assert stats.prefix_cache_hit_rate == pytest.approx(56 / 86)
    assert_idle(llm, "shared prefix")


def test_a_drained_engine_holds_every_block_free_or_cached_and_reuses_them_all():
    llm = _engine(True, max_num_seqs=4, num_pages=40)
    alloc = llm.scheduler.allocators[0]
    rng = random.Random(9)
    for _ in range(2):
        prompts = [[rng.randint(1, 400) for _ in range(rng.randint(8, 30))] for _ in range(4)]
        llm.generate(prompts, SamplingParams(max_new_tokens=3))
    assert_idle(llm, "drained")
    assert alloc.num_cached > 0 and alloc.num_free == alloc.num_blocks - 1
    # two requests of the longest length: more blocks than the pool has, so cached ones are evicted
    llm.generate([[rng.randint(1, 400) for _ in range(86)] for _ in range(2)], SamplingParams(max_new_tokens=10))
    assert alloc.num_evictions > 0
    assert_idle(llm, "after evicting")
    llm.reset_prefix_cache()
    assert alloc.num_cached == 0 and alloc.num_free == alloc.num_blocks - 1
    assert_idle(llm, "after reset")


def test_the_narrowing_model_runs_without_prefix_caching():
    llm = small_llm("narrow-tiny", dtype=torch.float32, enforce_eager=True)
    assert not llm.prefix_caching
    out = llm.generate([[5] * 12, [5] * 12], SamplingParams(max_new_tokens=2))
    assert [o.num_cached_tokens for o in out] == [0, 0] and llm.stats().prefix_cache_queries == 0


def test_compiled_engine_with_caching_gives_the_tokens_of_caching_off():
    """One compiled engine (its prefill graphs serve both runs): the workloads without caching, then
    with it; a hit runs the same compiled extend with a prefix that chunked prefill runs."""
    rng = random.Random(11)
    llm = _engine(False, enforce_eager=False)
    workloads = [_workload(rng, llm.scheduler.block_size, 5) for _ in range(2)]
    want = [ids(llm.generate(prompts, params)) for prompts, params in workloads]
    assert llm.scheduler.set_prefix_caching(True) and llm.prefix_caching
    assert [ids(llm.generate(prompts, params)) for prompts, params in workloads] == want
    assert llm.stats().prefix_cache_hits > 0
    assert_idle(llm, "compiled")
