"""Physical KV blocks, the free queue and the prefix-cache map.

Invariants:
- block 0 is the null block: never allocated, never freed, never cached;
- a block is in the free queue iff its ref_cnt == 0 (it may still hold a hash:
  such a block is a prefix-cache entry that is evicted lazily when reused);
- free-queue order is reuse order: unhashed blocks are put at the front (LIFO,
  they hold nothing worth keeping), hashed ones at the tail (LRU).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from conveyor.engine.core.request import Request

if TYPE_CHECKING:
    from conveyor.engine.dp.router.events import KVEventPublisher


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list over KVCacheBlock: O(1) remove from the middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        b = self._head.next_free
        if b is self._tail or b is None:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        b = self._head.next_free
        for _ in range(n):
            assert b is not None  # n <= num_free_blocks: n blocks precede the tail
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        assert b is not None  # the tail sentinel at worst
        self._head.next_free, b.prev_free = b, self._head
        self.num_free_blocks -= n
        return out

    def remove(self, b: KVCacheBlock) -> None:
        prev, nxt = b.prev_free, b.next_free
        assert prev is not None and nxt is not None  # b is free: the sentinels bound it
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # the head sentinel at worst
        last.next_free, b.prev_free = b, last
        b.next_free, self._tail.prev_free = self._tail, b
        self.num_free_blocks += 1

    def appendleft(self, b: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None  # the tail sentinel at worst
        self._head.next_free, b.prev_free = b, self._head
        b.next_free, first.prev_free = first, b
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        b = self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b)
            b = b.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}; two requests may compute the same block
        # concurrently, so one hash can map to several blocks.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Data parallel: the router's event stream (conveyor/engine/dp/router/events.py).
        # A hash is published when it first maps to a block, and as removed
        # when its last block is evicted; None (one engine): no cost at all.
        self.events: KVEventPublisher | None = None
        # A KV connector's hook: a computed block (block_id, hash) is about to be
        # reused; it is called before the new owner's step may overwrite it.
        self.on_evict: Callable[[int, bytes], None] | None = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] the request's hashes."""
        hashes = request.block_hashes
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.block_hash is not None:  # a prefix hit shared with another request
                continue
            h = hashes[i]
            blk.block_hash = h
            entry = table.get(h)
            if entry is None:
                entry = table[h] = {}
                if self.events is not None:
                    self.events.stored(h)
            entry[blk.block_id] = blk

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(n)
        if self.enable_caching:
            for b in blocks:
                if b.block_hash is not None:
                    if self.on_evict is not None:
                        self.on_evict(b.block_id, b.block_hash)
                    self._evict(b, b.block_hash)
                b.ref_cnt = 1
        else:
            for b in blocks:
                b.ref_cnt = 1
        return blocks

    def _evict(self, b: KVCacheBlock, block_hash: bytes) -> None:
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(b.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[block_hash]
                if self.events is not None:
                    self.events.removed(block_hash)
        b.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling idle ones out of the free queue."""
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given (eviction) order."""
        q = self.free_block_queue
        for b in ordered_blocks:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    q.appendleft(b)
                else:
                    q.append(b)

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False  # blocks in use still point at their hashes
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.block_hash = None
        if self.events is not None:
            self.events.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
