"""Router: one engine per request, scored on the request's own token ids.

kv_aware: cost(e) = uncached prefill tokens on e + lam x load(e), where load
is the work, in tokens, of the requests this router sent to e that have not
finished: each one's uncached prefill on e (as predicted at its decision) +
its max_tokens, counted at the moment of decision, so a burst of equal
requests spreads instead of piling on one engine. A cached prompt is not
work: counting whole prompts made a long conversation look as heavy as a long
uncached prompt and pushed it off the engine holding its history. Ties go to
the least loaded engine, then to a random one. The load check is per request,
in tokens, and against the preferred engine only: when the request's work on
top of what that engine holds exceeds `spill_ratio` x the mean held (+
`spill_slack` mean requests' worth), the request spills to the best engine
under that bound; nothing changes for any other request or prefix. Engines
report their queue in requests (other ingress replicas' requests show up only
there); a report counts as that many requests of this router's mean work.
The index matches the whole prompt (after the chat template), block by block
with the engine's own hash chain, so a system prompt every request shares
matches everywhere and settles nothing by itself.

LoRA adapters (kv_aware): an engine the router has sent an adapter to (or
that preloaded it) holds it, up to `max_adapters_per_engine` per engine, least
recently routed forgotten first (the engine's own host cache is LRU too).
Engines that do not hold the request's adapter pay `adapter_load_tokens` on
top of their cost, so the adapter sticks to its holders; when the best holder
is overloaded, the spill above picks the best engine under the bound, holder or
not, which then loads the adapter on demand and becomes a holder: a hot adapter
spreads over more engines as its load grows and is never pinned to one. The
prefix hashes carry the adapter id (block_hashes_of(lora_int_id=...)), so the
KV score only ever matches that adapter's own blocks.

KV tiers (conveyor/engine/kv_connector/): an engine reports the keys its host
and disk tiers hold; blocks that continue its pool match from a tier count
`tier_weight` of a pool block in the cost (a load is cheaper than a
recompute but not free), and in full in the predicted cached tokens.

session: the engine a session (x-session-id / `user`) went to last, unless
it is overloaded; kv_aware with a session gives that engine a soft bonus.
least_loaded, power_of_two and round_robin ignore the cache.
"""
from __future__ import annotations

import logging
import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from conveyor.engine.config.sections import ROUTER_POLICIES
from conveyor.engine.dp.router.events import KVEvents
from conveyor.engine.dp.router.index import PrefixIndex
from conveyor.engine.kv_cache.hashing import first_block_extra, hash_block, mm_block_extra
from conveyor.engine.multimodal.features import MultiModalFeature

log = logging.getLogger(__name__)

POLICIES = ROUTER_POLICIES  # the config owns the list
REASONS = ("cache_hit", "load_spill", "session", "fallback")
LAM_DEFAULT = 0.4


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "kv_aware"
    block_size: int = 16
    # Cost of one token of load (uncached prefill + decode still to come), in
    # uncached prefill tokens. See BENCHMARKS.md "Routing": bench/routing/routing.py's
    # simulation reaches >= 90% of the ideal hit rate at max/mean load <= 1.25
    # with it.
    lam: float = LAM_DEFAULT
    spill_ratio: float = 1.25
    spill_slack: float = 2.0  # mean requests' worth of tokens above spill_ratio x mean before a spill
    session_bonus_tokens: int = 256
    # Cost of an engine loading the request's adapter first, in prefill tokens:
    # above any load difference the spill bound lets through (lam x tokens), so
    # a holder under the bound always wins and a non-holder only takes a spill.
    adapter_load_tokens: float = 1e6
    max_adapters_per_engine: int = 64
    max_index_blocks_per_engine: int = 1 << 20
    # A block an engine holds in a KV tier, in pool blocks: measured with
    # bench/kv_tiers.py, a 976-token prefix loaded from disk after a restart
    # cut TTFT from 226 to 47 ms (0.79 of a recompute saved); the host tier
    # saves more. Below 1, so the pool's copy wins a tie.
    tier_weight: float = 0.75
    max_sessions: int = 100_000
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.tier_weight <= 1.0:
            raise ValueError(f"router tier_weight must be in [0, 1], got {self.tier_weight}")


@dataclass(frozen=True)
class Decision:
    engine: int
    reason: str  # one of REASONS
    predicted_cached_tokens: int


def block_hashes_of(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                    lora_int_id: int | None = None,
                    mm_features: list[MultiModalFeature] | None = None) -> list[bytes]:
    """The hashes the engine will compute for these tokens' full blocks
    (conveyor/engine/kv_cache/hashing.py's BlockHasher, same chain, same salt,
    same adapter, the same images in the blocks their placeholders meet)."""
    out: list[bytes] = []
    parent: bytes | None = None
    first = first_block_extra(cache_salt, lora_int_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = first if start == 0 else None
        if mm_features:
            extra = mm_block_extra(extra, mm_features, start, start + block_size)
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        out.append(parent)
    return out


class Router:
    def __init__(self, settings: RouterSettings, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.s = settings
        self.index = PrefixIndex(settings.max_index_blocks_per_engine)
        self.tiers = PrefixIndex(settings.max_index_blocks_per_engine)  # keys in the engines' KV tiers
        self.n = num_engines
        self.live = np.ones(num_engines, dtype=bool)
        self.load_tokens = np.zeros(num_engines, dtype=np.float64)
        self.inflight = np.zeros(num_engines, dtype=np.int64)
        # What each engine last reported holding (waiting + running): other
        # routers' requests (several ingress replicas) show up here.
        self.reported = np.zeros(num_engines, dtype=np.int64)
        self._requests: dict[str, tuple[int, int]] = {}  # id -> (engine, load tokens)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._rng = random.Random(settings.seed)
        self._rr = 0
        self._all_mask = (1 << num_engines) - 1
        # The engines one route() call may pick (live, and in its `only`).
        self._ok = self.live
        self._ok_bits = self._all_mask
        self.decisions: dict[tuple[str, str, int], int] = {}
        # Per engine: the adapters it holds, least recently routed first.
        self._adapters: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_engines)]
        for e in range(num_engines):
            self.index.add_engine(e)
            self.tiers.add_engine(e)

    # ---- engines and their streams ---------------------------------------------------

    def on_events(self, engine: int, ev: KVEvents) -> bool:
        """Feed one message of an engine's stream; False: ask it for a snapshot."""
        if ev.load is not None:
            self.reported[engine] = ev.load.num_waiting + ev.load.num_running
        ok = self.index.apply(engine, ev)
        # Same epoch and seq: the tier index sees the same gaps and snapshots.
        self.tiers.apply(engine, KVEvents(ev.epoch, ev.seq, ev.tier_stored, ev.tier_removed,
                                          snapshot=ev.snapshot))
        return ok

    def engine_down(self, engine: int) -> None:
        """Dead or restarting: route nothing there, forget its cache."""
        self.live[engine] = False
        self.reported[engine] = 0
        self._all_mask &= ~(1 << engine)
        self.index.drop_engine(engine)
        self.tiers.drop_engine(engine)
        self._adapters[engine].clear()

    def engine_up(self, engine: int) -> None:
        self.live[engine] = True
        self._all_mask |= 1 << engine
        self.index.add_engine(engine)
        self.tiers.add_engine(engine)

    def add_engine(self) -> int:
        """One more engine slot (autoscaling), down until engine_up; its index."""
        e = self.n
        self.n += 1
        self.live = np.append(self.live, False)
        self.load_tokens = np.append(self.load_tokens, 0.0)
        self.inflight = np.append(self.inflight, 0)
        self.reported = np.append(self.reported, 0)
        self._adapters.append(OrderedDict())
        return e

    def adapter_loaded(self, engine: int, adapter: str) -> None:
        """The engine holds `adapter` (preloaded, or sent a request for it)."""
        held = self._adapters[engine]
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.s.max_adapters_per_engine:
            held.popitem(last=False)

    def adapter_unloaded(self, adapter: str) -> None:
        for held in self._adapters:
            held.pop(adapter, None)

    def engines_holding(self, adapter: str) -> list[int]:
        return [e for e, held in enumerate(self._adapters) if adapter in held]

    # ---- decisions -----------------------------------------------------------------

    def route(self, request_id: str, hashes: list[bytes], num_tokens: int, max_tokens: int = 0,
              session: str | None = None, adapter: str | None = None,
              only: list[int] | None = None) -> Decision:
        """Pick an engine and count the request on it now (before any other decision).
        `adapter`: the request's LoRA adapter name (None: the base model);
        `only`: the engines it may go to (P/D roles; None: any live one)."""
        self._ok, self._ok_bits = self.live, self._all_mask
        if only is not None:
            allowed = np.zeros(self.n, dtype=bool)
            allowed[[e for e in only if e < self.n]] = True
            self._ok = self.live & allowed
            self._ok_bits = self._all_mask & sum(1 << e for e in only)
            if not self._ok.any():
                raise ValueError(f"no live engine among {only}")
        p = self.s.policy
        if p == "kv_aware":
            d = self._kv_aware(hashes, num_tokens, max_tokens, session, adapter)
        elif p == "session":
            d = self._session(hashes, num_tokens, max_tokens, session)
        else:
            e = self._by_load(p)
            d = Decision(e, "fallback", self._cached_on(e, hashes, num_tokens))
        if session is not None:
            self._remember_session(session, d.engine)
        if adapter is not None:
            self.adapter_loaded(d.engine, adapter)
        self._count(request_id, d, num_tokens - d.predicted_cached_tokens + max_tokens, p)
        return d

    def finish(self, request_id: str) -> None:
        """The request ended (any way): its load leaves its engine."""
        got = self._requests.pop(request_id, None)
        if got is not None:
            e, tokens = got
            self.load_tokens[e] -= tokens
            self.inflight[e] -= 1

    def _count(self, request_id: str, d: Decision, tokens: int, policy: str) -> None:
        self._requests[request_id] = (d.engine, tokens)
        self.load_tokens[d.engine] += tokens
        self.inflight[d.engine] += 1
        key = (policy, d.reason, d.engine)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        log.debug("route %s -> engine %d (%s), predicted cached tokens %d",
                  request_id, d.engine, d.reason, d.predicted_cached_tokens)

    def _cached_tokens(self, blocks: int, num_tokens: int) -> int:
        # The engine's own cap: whole blocks, at most num_tokens - 1.
        bs = self.s.block_size
        return min(blocks, max(num_tokens - 1, 0) // bs) * bs

    def _cached_on(self, e: int, hashes: list[bytes], num_tokens: int) -> int:
        return self._matches(hashes, num_tokens, 1 << e)[0].get(e, 0)

    def _matches(self, hashes: list[bytes], num_tokens: int, mask: int
                 ) -> tuple[dict[int, int], dict[int, float]]:
        """Per engine in mask: (tokens it would reuse: its pool's leading
        blocks, then the blocks its tiers hold after those; the same with the
        tier blocks weighed tier_weight)."""
        pool = self.index.match(hashes, mask)
        cached: dict[int, int] = {}
        score: dict[int, float] = {}
        if not self.tiers.owners:  # no engine runs a tier: the pools alone
            for e, b in pool.items():
                cached[e] = self._cached_tokens(b, num_tokens)
                score[e] = float(cached[e])
            return cached, score
        w = self.s.tier_weight
        for e in _bits(mask):
            p = pool.get(e, 0)
            total = self._cached_tokens(p + self.tiers.run_from(hashes, e, p), num_tokens)
            if total:
                local = self._cached_tokens(p, num_tokens)
                cached[e] = total
                score[e] = local + w * (total - local)
        return cached, score

    def best_in_tiers_elsewhere(self, hashes: list[bytes], num_tokens: int, engine: int) -> int:
        """The longest prefix of this prompt, in tokens, another live engine
        holds in its tiers (with a disk tier: its finished requests' blocks,
        written or being written to the shared KV folder)."""
        blocks = self.tiers.match(hashes, self._all_mask & ~(1 << engine))
        return self._cached_tokens(max(blocks.values(), default=0), num_tokens)

    def _kv_aware(self, hashes: list[bytes], num_tokens: int, max_tokens: int,
                  session: str | None, adapter: str | None) -> Decision:
        cached, score = self._matches(hashes, num_tokens, self._ok_bits)
        uncached = np.full(self.n, float(num_tokens))
        for e, t in score.items():
            uncached[e] -= t
        cost = uncached + self.s.lam * self.load_tokens
        sess_e = self._sessions.get(session) if session is not None else None
        if sess_e is not None:
            cost[sess_e] -= self.s.session_bonus_tokens
        if adapter is not None:
            holds = np.array([adapter in held for held in self._adapters])
            cost[~holds] += self.s.adapter_load_tokens
        cost[~self._ok] = np.inf
        e = self._argmin(cost)
        end = self._held_tokens(uncached + max_tokens)
        if end[e] > self._spill_bound(uncached + max_tokens):
            # Spill to the cheapest engine that ends up holding less than e would.
            cost[end >= end[e]] = np.inf
            if np.isfinite(cost).any():
                e = self._argmin(cost)
                return Decision(e, "load_spill", cached.get(e, 0))
        reason = "cache_hit" if cached.get(e, 0) > 0 else ("session" if e == sess_e else "fallback")
        return Decision(e, reason, cached.get(e, 0))

    def _session(self, hashes: list[bytes], num_tokens: int, max_tokens: int,
                 session: str | None) -> Decision:
        e = self._sessions.get(session) if session is not None else None
        if e is not None and self._ok[e]:
            cached = self._cached_on(e, hashes, num_tokens)
            work = np.full(self.n, float(num_tokens - cached + max_tokens))
            if self._held_tokens(work)[e] <= self._spill_bound(work):
                return Decision(e, "session", cached)
        e = self._by_load("least_loaded")
        return Decision(e, "fallback", self._cached_on(e, hashes, num_tokens))

    def _by_load(self, policy: str) -> int:
        live = np.flatnonzero(self._ok)
        if policy == "round_robin":
            self._rr += 1
            return int(live[self._rr % len(live)])
        if policy == "power_of_two" and len(live) > 1:
            a, b = self._rng.sample(range(len(live)), 2)
            ea, eb = int(live[a]), int(live[b])
            return ea if self.load_tokens[ea] <= self.load_tokens[eb] else eb
        load = np.where(self._ok, self.load_tokens, np.inf)
        return self._argmin(load)

    def _argmin(self, cost: np.ndarray) -> int:
        """Lowest cost; ties: least load, then random."""
        best = np.flatnonzero(cost == cost.min())
        if len(best) > 1:
            loads = self.load_tokens[best]
            best = best[loads == loads.min()]
        return int(best[0] if len(best) == 1 else best[self._rng.randrange(len(best))])

    def _per_request(self, work: np.ndarray) -> float:
        """This router's mean work per in-flight request, in tokens (the
        request's own mean work when nothing is in flight)."""
        n_in = int(self.inflight.sum())
        if n_in > 0:
            return float(self.load_tokens.sum()) / n_in
        live = work[self._ok]
        return float(live.mean()) if len(live) else 0.0

    def _held_tokens(self, work: np.ndarray) -> np.ndarray:
        """What each engine would hold with this request's work on it, in
        tokens: this router's load, or the engine's own report of its queue
        (requests, other routers' included) x the mean work per request."""
        held: np.ndarray = np.maximum(self.load_tokens, self.reported * self._per_request(work)) + work
        return held

    def _spill_bound(self, work: np.ndarray) -> float:
        """spill_ratio x the mean held over live engines + spill_slack mean requests."""
        per_req = self._per_request(work)
        held = np.maximum(self.load_tokens, self.reported * per_req)[self._ok]
        return (self.s.spill_ratio * float(held.mean()) if len(held) else 0.0) + self.s.spill_slack * per_req

    def _remember_session(self, session: str, e: int) -> None:
        s = self._sessions
        s[session] = e
        s.move_to_end(session)
        if len(s) > self.s.max_sessions:
            s.popitem(last=False)

    # ---- what metrics read -----------------------------------------------------------

    def index_size(self, engine: int) -> int:
        return self.index.size(engine)


def _bits(mask: int) -> list[int]:
    """The engines in a bitmask, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
