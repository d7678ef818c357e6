"""Requests parked in WAITING_FOR_REMOTE_KVS, and blocks a load may still write.

A waiting request whose prefix continues in a KV connector holds its pool
blocks (local hit + blocks for the external tokens) and waits here until the
worker reports its load finished; then it goes back to the front of the
waiting queue with num_computed_tokens cut to its longest valid prefix.
Invariants:
- a parked request is in neither waiting nor running, and holds its blocks
  in the KVCacheManager; it is parked at most once at a time;
- every parked request leaves by its deadline (kv_load_timeout_s): then it
  recomputes from scratch and never asks a tier again (the connector's rule);
- a load the scheduler stopped waiting for (deadline, abort) may still
  write its blocks: they stay held here, as orphans, until the worker
  reports that load finished, and only then return to the pool.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.engine.contracts import RequestStatus
from conveyor.engine.core.request import Request
from conveyor.engine.kv_cache import KVCacheBlock, KVCacheManager
from conveyor.engine.kv_connector.base import KVConnectorScheduler, LoadResult

log = logging.getLogger(__name__)


@dataclass
class _Parked:
    request: Request
    load_id: int
    deadline: float
    prior_status: RequestStatus  # WAITING or PREEMPTED: how it is scheduled once back
    since: float = 0.0  # when it was parked (its load's latency in the debug log)


class RemoteKVWaits:
    def __init__(self, connector: KVConnectorScheduler, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.connector = connector
        self.timeout_s = timeout_s
        self.clock = clock
        self.parked: dict[str, _Parked] = {}
        self.orphans: dict[int, list[KVCacheBlock]] = {}
        self.num_timeouts = 0  # since the last stats
        self.total_timeouts = 0

    def take_timeouts(self) -> int:
        n, self.num_timeouts = self.num_timeouts, 0
        return n

    def busy(self) -> bool:
        return bool(self.parked) or bool(self.orphans)

    def park(self, request: Request, load_id: int) -> None:
        assert request.request_id not in self.parked
        now = self.clock()
        self.parked[request.request_id] = _Parked(request, load_id, now + self.timeout_s, request.status, now)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def finish_loads(self, results: list[LoadResult], kv: KVCacheManager) -> list[Request]:
        """Apply finished loads; the requests ready to be scheduled again."""
        back = []
        for r in results:
            p = self.parked.get(r.req_id)
            if p is not None and p.load_id == r.load_id:
                del self.parked[r.req_id]
                req = p.request
                log.debug("request %s: prefix %d tokens from the pool, %s from tiers (%d bytes in "
                          "%.1f ms), %d loaded tokens invalid (recomputed)", req.request_id,
                          req.num_computed_tokens, r.by_source or "none", r.nbytes,
                          1e3 * (self.clock() - p.since), _asked(kv, req) - r.num_valid_tokens)
                req.num_computed_tokens += r.num_valid_tokens
                if req.num_computed_tokens == 0:
                    # Nothing valid: a request that computed nothing holds no blocks
                    # (admission looks its prefix up afresh).
                    kv.free(req)
                req.status = p.prior_status
                back.append(req)
            blocks = self.orphans.pop(r.load_id, None)
            if blocks:
                kv.block_pool.free_blocks(reversed(blocks))
        return back

    def expire(self, kv: KVCacheManager) -> list[Request]:
        """Requests past their deadline, set to recompute from scratch."""
        now = self.clock()
        late = [p for p in self.parked.values() if p.deadline <= now]
        for p in late:
            log.warning("request %s: KV load %d not finished after %.1f s; recomputing",
                        p.request.request_id, p.load_id, self.timeout_s)
            self.num_timeouts += 1
            self.total_timeouts += 1
            self._give_up(p, kv)
            p.request.status = p.prior_status
        return [p.request for p in late]

    def drop(self, request: Request, kv: KVCacheManager) -> None:
        """The request ends (abort) while parked."""
        self._give_up(self.parked[request.request_id], kv)

    def _give_up(self, p: _Parked, kv: KVCacheManager) -> None:
        rid = p.request.request_id
        del self.parked[rid]
        blocks = kv.req_to_blocks.pop(rid, [])
        kv.num_cached_block.pop(rid, None)
        if blocks:
            self.orphans[p.load_id] = blocks
        p.request.num_computed_tokens = 0
        self.connector.give_up_load(p.load_id, rid)

    def take_all(self) -> list[Request]:
        """The worker group is gone (and with it every load): the parked
        requests, to recompute; orphans went with the old KV manager."""
        reqs = [p.request for p in self.parked.values()]
        for p in self.parked.values():
            p.request.status = p.prior_status
        self.parked.clear()
        self.orphans.clear()
        return reqs


def spill_held(waiting: Iterable[Request], kv: KVCacheManager) -> bool:
    """Waiting requests back from a load hold their blocks; when the pool is
    too full to admit the next request, they give them back as prefix-cache
    entries (the loaded, valid prefix is hashed first, so their re-admission
    finds it locally unless it is evicted meanwhile) and start from 0. Without
    this, block-holding waiters could starve each other. True if any did."""
    spilled = False
    for r in waiting:
        if kv.req_to_blocks.get(r.request_id):  # a failed allocation leaves an empty list
            if kv.enable_caching:
                kv.cache_blocks(r, r.num_computed_tokens)
            kv.free(r)
            r.num_computed_tokens = 0
            spilled = True
    return spilled


def _asked(kv: KVCacheManager, req: Request) -> int:
    """Tokens the request's blocks cover beyond its computed prefix (what its load was asked)."""
    return len(kv.req_to_blocks.get(req.request_id, ())) * kv.block_size - req.num_computed_tokens
