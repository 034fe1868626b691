from tscompile.kv_cache.pool import BlockAllocator, GroupStorage, KVCachePool
from tscompile.kv_cache.slots import expand_block_table, slot_from_block_table, slot_from_page_table
from tscompile.kv_cache.spec import CacheGeometry, CacheGroupSpec, kept_rows

__all__ = [
    "BlockAllocator", "CacheGeometry", "CacheGroupSpec", "GroupStorage", "KVCachePool",
    "expand_block_table", "kept_rows", "slot_from_block_table", "slot_from_page_table",
]
