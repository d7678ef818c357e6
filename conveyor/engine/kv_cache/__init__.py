"""Paged KV cache bookkeeping on the engine side (no tensors here)."""
from conveyor.engine.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from conveyor.engine.kv_cache.hashing import BlockHasher
from conveyor.engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockHasher", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager"]
