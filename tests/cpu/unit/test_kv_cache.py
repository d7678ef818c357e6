"""KV cache manager and block pool: prefix caching, eviction order, ref counts."""
from __future__ import annotations

import pytest
from sched_utils import append_token, make_request

from conveyor.engine.contracts import RequestStatus
from conveyor.engine.kv_cache import BlockHasher, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager

COMMON = [0] * 16 + [1] * 16 + [2] * 16


def _mgr(num_blocks: int = 11) -> tuple[KVCacheManager, BlockHasher]:
    return KVCacheManager(num_blocks, 16, 4096, enable_caching=True), BlockHasher(16)


def _req(rid: str, prompt: list[int], hasher: BlockHasher, salt: str | None = None):
    r = make_request(rid, prompt, cache_salt=salt)
    hasher.extend(r)
    return r


def _admit(mgr: KVCacheManager, r):
    hits, n = mgr.get_computed_blocks(r)
    blocks = mgr.allocate_slots(r, r.num_tokens - n, n, hits)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens
    return hits, n, blocks


def test_free_queue_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.popleft_n(3)] == [0, 1, 3]
    assert q.num_free_blocks == 2
    with pytest.raises(ValueError):
        q.popleft_n(3)


def test_prefix_hit_eviction_order_and_salt():
    mgr, hasher = _mgr()
    r0 = _req("0", COMMON + [3] * 7, hasher)
    hits, n, blocks = _admit(mgr, r0)
    assert n == 0 and [b.block_id for b in blocks] == [1, 2, 3, 4]
    r1 = _req("1", COMMON + [4] * 5, hasher)
    hits, n, blocks = _admit(mgr, r1)
    assert [b.block_id for b in hits] == [1, 2, 3] and n == 48
    assert [b.block_id for b in blocks] == [5]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    mgr.free(r0)
    mgr.free(r1)
    free = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert free == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # Same prefix + same salt hits; another salt does not.
    same = _req("2", COMMON + [9], hasher)
    assert mgr.get_computed_blocks(same)[1] == 48
    salted_a = _req("3", COMMON + [9], hasher, salt="a")
    assert mgr.get_computed_blocks(salted_a)[1] == 0
    # A 160-token miss takes every free block, evicting in queue order.
    big = _req("4", list(range(100, 260)), hasher)
    hits, n, blocks = _admit(mgr, big)
    assert n == 0 and [b.block_id for b in blocks] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert mgr.get_computed_blocks(same)[1] == 0  # the common prefix is gone
    assert mgr.block_pool.cached_block_hash_to_block.keys() == {h for h in big.block_hashes}


def test_salted_requests_share_with_same_salt():
    mgr, hasher = _mgr()
    a = _req("a", COMMON + [5], hasher, salt="s1")
    _admit(mgr, a)
    assert mgr.get_computed_blocks(_req("b", COMMON + [6], hasher, salt="s1"))[1] == 48
    assert mgr.get_computed_blocks(_req("c", COMMON + [6], hasher, salt="s2"))[1] == 0


def test_hit_capped_below_num_tokens():
    mgr, hasher = _mgr()
    _admit(mgr, _req("0", COMMON, hasher))
    # An identical 48-token prompt may reuse only 2 blocks: the last token is recomputed.
    assert mgr.get_computed_blocks(_req("1", COMMON, hasher))[1] == 32


def test_failed_allocation_leaves_ref_counts():
    mgr, hasher = _mgr(num_blocks=6)  # 5 usable
    r0 = _req("0", COMMON + [3], hasher)
    _admit(mgr, r0)  # 4 blocks
    mgr.free(r0)
    hog = _req("hog", [7] * 16, hasher)
    _admit(mgr, hog)  # takes the unhashed block first
    before = [b.ref_cnt for b in mgr.block_pool.blocks]
    r1 = _req("1", COMMON + [8] * 40, hasher)  # hits 3 blocks, needs 6 in all
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 48
    assert mgr.allocate_slots(r1, r1.num_tokens - n, n, hits) is None
    assert [b.ref_cnt for b in mgr.block_pool.blocks] == before
    assert mgr.get_num_free_blocks() == 4


def test_whole_prompt_admission_gate():
    mgr, hasher = _mgr(num_blocks=6)  # 5 usable
    r = _req("0", list(range(1, 97)), hasher)  # 6 blocks for the whole prompt
    assert mgr.allocate_slots(r, 16) is None  # even though one chunk would fit
    r2 = _req("1", list(range(1, 81)), hasher)  # 5 blocks: fits
    assert len(mgr.allocate_slots(r2, 16)) == 1


def test_usage_and_reset():
    mgr, hasher = _mgr()
    r = _req("0", list(range(1, 18)), hasher)
    blocks = mgr.allocate_slots(r, 17)
    assert len(blocks) == 2
    assert abs(mgr.usage - 0.2) < 1e-9
    assert not mgr.reset_prefix_cache()  # blocks in use
    mgr.free(r)
    assert mgr.reset_prefix_cache()
    assert not mgr.block_pool.cached_block_hash_to_block
    st = mgr.make_prefix_cache_stats()
    assert (st.requests, st.queries, st.hits) == (0, 0, 0)


def test_incremental_hashing_matches_full():
    h = BlockHasher(16)
    r = make_request("0", list(range(20)))
    h.extend(r)
    assert len(r.block_hashes) == 1
    for t in range(20, 40):
        append_token(r, t)
        h.extend(r)
    full = make_request("1", list(range(40)))
    h.extend(full)
    assert r.block_hashes == full.block_hashes and len(full.block_hashes) == 2


def test_prefix_stats_in_tokens():
    mgr, hasher = _mgr()
    _admit(mgr, _req("0", COMMON + [1], hasher))
    mgr.get_computed_blocks(_req("1", COMMON + [2], hasher))
    st = mgr.make_prefix_cache_stats()
    assert (st.requests, st.queries, st.hits) == (2, 98, 48)
