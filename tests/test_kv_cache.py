"""Slot math, block-table expansion, the null page and the allocator."""

import random

import pytest
import torch

from tscompile.kv_cache import BlockAllocator, expand_block_table, slot_from_block_table, slot_from_page_table
from tscompile.kv_cache.slots import expand_block_table_rows, slot_from_block_rows


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_slot_math_equals_raw_table_slot(page_size, pages_per_block):
    g = torch.Generator().manual_seed(page_size * 10 + pages_per_block)
    block_size = page_size * pages_per_block
    n, max_blocks = 6, 5
    blocks = (torch.randperm(60, generator=g)[: n * max_blocks] + 1).view(n, max_blocks).to(torch.int32)
    max_pages = max_blocks * pages_per_block
    pages = expand_block_table(blocks, pages_per_block, max_pages)
    for width in (max_pages, max_pages + 3, max_pages - 1):  # the host form agrees, tables wider or narrower too
        assert expand_block_table_rows(blocks.numpy(), pages_per_block, width).tolist() == \
            expand_block_table(blocks, pages_per_block, width).tolist()
    positions = torch.randint(0, max_blocks * block_size, (n,), generator=g)
    via_pages = slot_from_page_table(pages, positions, page_size)
    raw = [int(blocks[i, int(p) // block_size]) * block_size + int(p) % block_size for i, p in enumerate(positions)]
    assert via_pages.tolist() == raw
    assert slot_from_block_table(blocks, positions, block_size).tolist() == raw
    rows = torch.arange(n).repeat_interleave(3)  # the host form, several rows per request
    pos3 = torch.randint(0, max_blocks * block_size, (3 * n,), generator=g)
    raw3 = [int(blocks[r, int(p) // block_size]) * block_size + int(p) % block_size for r, p in zip(rows, pos3)]
    assert slot_from_block_rows(blocks.numpy(), rows.numpy(), pos3.numpy(), block_size).tolist() == raw3


def test_empty_block_entries_map_to_page_zero():
    blocks = torch.tensor([[3, 0, 0], [0, 0, 0]], dtype=torch.int32)
    pages = expand_block_table(blocks, 2, 6)
    assert pages.tolist() == [[6, 7, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]


def test_allocator_never_hands_out_block_zero_and_refuses_when_exhausted():
    alloc = BlockAllocator(5)
    got = alloc.allocate(4)
    assert sorted(got) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"tscompile: page pool exhausted .* need 1 blocks, 0 free of 4"):
        alloc.allocate(1)
    alloc.free(got[:2])
    assert 0 not in alloc.allocate(2)


def test_allocator_hands_out_the_ids_one_pop_at_a_time_would():
    """``allocate`` takes its blocks as one slice: the ids and their order are those of popping the
    free list one block at a time, through any mix of allocations (0 blocks, all of them) and frees."""
    rng = random.Random(0)
    for num_blocks in (2, 3, 9, 40):
        alloc, free, held = BlockAllocator(num_blocks), list(range(num_blocks - 1, 0, -1)), []
        for _ in range(200):
            if held and rng.random() < 0.4:
                blocks = held.pop(rng.randrange(len(held)))
                alloc.free(blocks)
                free.extend(reversed(blocks))
            else:
                n = rng.randint(0, len(free))
                expected = [free.pop() for _ in range(n)]
                assert alloc.allocate(n) == expected
                held.append(expected)
            assert alloc.num_free == len(free)


def test_allocator_refuses_to_free_a_block_outside_the_pool():
    alloc = BlockAllocator(5)
    with pytest.raises(AssertionError, match="freeing block 5 outside the pool"):
        alloc.free([1, 5])
