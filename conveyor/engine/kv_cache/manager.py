"""KVCacheManager: which blocks each request holds, prefix-cache lookups and
the admission arithmetic. The worker-side BlockTable mirrors req_to_blocks
through SchedulerOutput diffs."""
from __future__ import annotations

from conveyor.engine.contracts import PrefixCacheStats, RequestStatus
from conveyor.engine.core.request import Request
from conveyor.engine.kv_cache.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request that already carry a hash.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (the caller accumulates)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request.

        The hit is capped at num_tokens - 1: the last token must be computed to
        produce logits."""
        # prompt_logprobs still to compute: every prompt position needs its
        # logits, so nothing is read from the cache (vLLM V1 skips it too);
        # its blocks are still cached for later requests, and once the prompt
        # logprobs were sent (a preempted request resuming) the cache is read.
        if not self.enable_caching or request.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for h in request.block_hashes[:max_hit_blocks]:
            blk = get(h)
            if blk is None:
                break
            hits.append(blk)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       delay_cache: bool = False) -> list[KVCacheBlock] | None:
        """Reserve slots for num_new_tokens more tokens; None if they do not fit.

        A request that is not yet running (waiting or resumed) is admitted only
        if its whole prompt fits, so a long prompt never starts chunking into a
        cache it cannot finish in. On None nothing has changed (prefix-hit
        blocks keep their ref counts). delay_cache: hash nothing yet (blocks a
        KV connector still has to fill must not be prefix hits)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if (req_blocks is not None and not new_computed_blocks
                and request.status == RequestStatus.RUNNING):
            # Fast path (decode): most steps need no new block at all.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(req_blocks) * self.block_size:
                if self.enable_caching:
                    self.cache_blocks(request, min(end, len(request.all_token_ids)))
                return []
        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed + num_new_tokens, self.max_model_len)
        num_held = len(req_blocks) + len(new_computed_blocks)
        num_new_blocks = max(cdiv(num_tokens_need_slot, self.block_size) - num_held, 0)
        # Idle prefix-hit blocks sit in the free queue: touching them consumes it.
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        need = num_new_blocks + num_evictable
        if request.status != RequestStatus.RUNNING:
            full = min(max(num_tokens_need_slot, request.num_tokens), self.max_model_len)
            need = max(need, cdiv(full, self.block_size) - num_held + num_evictable)
        if need > self.block_pool.get_num_free_blocks():
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the blocks that the first num_tokens tokens fill completely."""
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a prefix outlives its suffix in the LRU."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.num_cached_block.clear()
        return ok

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

