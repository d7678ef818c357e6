"""The routing simulation: the real Router (conveyor/engine/dp/router/) in front of N
simulated engines.

A simulated engine has an LRU cache of C blocks (keyed by the same block
hashes the real engine computes) and a token-budget service model: each tick
it spends at most `budget` tokens, one per running request in decode first,
then on the uncached part of admitted prompts in arrival order (at most
`max_running` requests admitted). A prompt's blocks enter its cache (LRU,
evicting the least recently used) when its prefill ends, and are touched when
a later prompt hits them; every insert and eviction goes through a real
KVEventPublisher, and the router's index is fed only from those events.
"""
from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from bench.lib.stats import percentile
from conveyor.engine.dp.router.events import EngineLoad, KVEventPublisher
from conveyor.engine.dp.router.policy import Router, RouterSettings


@dataclass
class SimRequest:
    """A request as the router sees it (block hashes) plus what the simulation fills in."""
    rid: str
    hashes: list[bytes]
    num_tokens: int
    output_len: int
    arrival: int  # tick
    session: str | None = None
    # Filled by the simulation.
    engine: int = -1
    hit_tokens: int = 0
    prefill_left: int = 0
    decode_left: int = 0
    finish: int = -1


class SimEngine:
    """An LRU prefix cache and a token-budget service model behind a real event publisher."""
    def __init__(self, capacity_blocks: int, block_size: int, budget: int, max_running: int) -> None:
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.capacity, self.bs, self.budget, self.max_running = capacity_blocks, block_size, budget, max_running
        self.events = KVEventPublisher(seed=0)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    def admit(self) -> None:
        """Admit waiting requests up to max_running; their cached prefix is skipped."""
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            hit = 0
            for h in r.hashes[:(r.num_tokens - 1) // self.bs]:
                if h not in self.cache:
                    break
                self.cache.move_to_end(h)
                hit += 1
            r.hit_tokens = hit * self.bs
            r.prefill_left = r.num_tokens - r.hit_tokens
            r.decode_left = r.output_len
            self.running.append(r)

    def insert(self, hashes: list[bytes]) -> None:
        """Blocks into the cache (LRU), publishing each store and eviction."""
        c = self.cache
        for h in hashes:
            if h in c:
                c.move_to_end(h)
                continue
            c[h] = None
            self.events.stored(h)
            if len(c) > self.capacity:
                old, _ = c.popitem(last=False)
                self.events.removed(old)

    def tick(self, now: int) -> list[SimRequest]:
        """One step; returns the requests that finished."""
        self.admit()
        budget, done = self.budget, []
        for r in self.running:
            if r.prefill_left == 0 and r.decode_left > 0:
                r.decode_left -= 1
                budget -= 1
        for r in self.running:
            if budget <= 0:
                break
            if r.prefill_left > 0:
                n = min(r.prefill_left, budget)
                r.prefill_left -= n
                budget -= n
                if r.prefill_left == 0:
                    self.insert(r.hashes)
        keep = []
        for r in self.running:
            if r.prefill_left == 0 and r.decode_left == 0:
                r.finish = now
                done.append(r)
            else:
                keep.append(r)
        self.running = keep
        return done

    def load(self) -> EngineLoad:
        """The engine's load as the router reads it."""
        return EngineLoad(len(self.waiting), len(self.running), self.capacity - len(self.cache))


@dataclass
class SimResult:
    """One policy's hit rate (and the ideal), imbalance and decision latencies."""
    policy: str
    hit_rate: float
    ideal_hit_rate: float
    imbalance: float  # max over engines of mean running / mean over engines
    imbalance_p90: float  # p90 over ticks of instantaneous max/mean (ticks with mean >= 4)
    decision_us: list[float] = field(default_factory=list)
    order: list[SimRequest] = field(default_factory=list)


class FollowUps:
    """Requests released only when an earlier one finishes (multi-turn)."""

    def next_after(self, done: SimRequest, now: int) -> list[SimRequest]:
        """The requests released by ``done`` finishing (none by default)."""
        return []


def simulate(requests: list[SimRequest], n: int, settings: RouterSettings, capacity: int,
             budget: int, max_running: int, follow: FollowUps | None = None) -> SimResult:
    """Route every request (and its follow-ups) through the real Router to n SimEngines, tick by tick."""
    router = Router(settings, n)
    engines = [SimEngine(capacity, settings.block_size, budget, max_running) for _ in range(n)]
    pending = [(r.arrival, i, r) for i, r in enumerate(requests)]
    heapq.heapify(pending)
    seq = len(pending)
    order: list[SimRequest] = []
    lat: list[float] = []
    running_sum = np.zeros(n)
    inst: list[float] = []
    ticks = 0
    now = 0
    live = 0
    while pending or live:
        while pending and pending[0][0] <= now:
            _, _, r = heapq.heappop(pending)
            t0 = time.perf_counter()
            d = router.route(r.rid, r.hashes, r.num_tokens, r.output_len, r.session)
            lat.append((time.perf_counter() - t0) * 1e6)
            r.engine = d.engine
            engines[d.engine].waiting.append(r)
            order.append(r)
            live += 1
        for e, eng in enumerate(engines):
            for r in eng.tick(now):
                router.finish(r.rid)
                live -= 1
                for nxt in (follow.next_after(r, now) if follow else []):
                    seq += 1
                    heapq.heappush(pending, (nxt.arrival, seq, nxt))
            ev = eng.events.drain(eng.load())
            if ev is not None:
                router.on_events(e, ev)
        counts = np.array([len(x.running) + len(x.waiting) for x in engines], dtype=float)
        if live:
            running_sum += counts
            ticks += 1
            if counts.mean() >= 4:
                inst.append(counts.max() / counts.mean())
        now += 1
        if not live and pending:
            now = max(now, pending[0][0])
    total = sum(r.num_tokens for r in order)
    hits = sum(r.hit_tokens for r in order)
    mean_run = running_sum / max(ticks, 1)
    return SimResult(settings.policy, hits / total, ideal_hit_rate(order, n * capacity, settings.block_size),
                     float(mean_run.max() / mean_run.mean()) if mean_run.mean() > 0 else 1.0,
                     percentile(inst, 90) if inst else 1.0, lat, order)


def ideal_hit_rate(order: list[SimRequest], capacity: int, bs: int) -> float:
    """One LRU cache with the whole cluster's capacity, the same order."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for r in order:
        n = 0
        for h in r.hashes[:(r.num_tokens - 1) // bs]:
            if h not in cache:
                break
            cache.move_to_end(h)
            n += 1
        hits += n * bs
        total += r.num_tokens
        for h in r.hashes:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total
