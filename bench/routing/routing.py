"""Routing benchmark, part (a): the real router against simulated engines.

For each workload (shared prefix, multi-turn, a Mooncake-format trace) and
each policy: the prefix-cache hit rate against the ideal (one LRU cache with
the cluster's total capacity, same request order), load imbalance (max over
engines of the mean number of requests held, over their mean; and the p90
over ticks of the instantaneous max/mean), then the router's decision latency
(route() alone, the block hashes given: the frontend computes them once, with
the engine's own function) at 8, 64 and 512 engines on the trace: wall-clock
p50/p99, and p99 of the thread's CPU time (on a shared 2-core host the wall
p99 is mostly time slices lost to other processes).

Usage: python bench/routing/routing.py [--engines 8] [--quick]
       python bench/routing/routing.py --write-trace bench/data/mooncake_synth.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.lib.stats import percentile  # noqa: E402
from bench.routing.routing_sim import SimRequest, simulate  # noqa: E402
from bench.routing.routing_workloads import MultiTurn, shared_prefix, trace, write_synthetic_trace  # noqa: E402
from conveyor.engine.dp.router.events import KVEvents  # noqa: E402
from conveyor.engine.dp.router.policy import POLICIES, Router, RouterSettings  # noqa: E402

BS = 16
LAM = float(os.environ.get("ROUTER_LAM", RouterSettings.lam))
TRACE = os.path.join(ROOT, "bench", "data", "mooncake_synth.jsonl")
# Per workload: engine cache blocks, token budget per tick, max running.
SIZES = {"shared_prefix": (320, 512, 64), "multi_turn": (560, 512, 64), "trace": (1600, 1024, 64)}


def _workload(name: str, quick: bool) -> tuple[list[SimRequest], MultiTurn | None]:
    if name == "shared_prefix":
        return shared_prefix(BS, per_group=16 if quick else 48), None
    if name == "multi_turn":
        mt = MultiTurn(BS, convs=32 if quick else 96)
        return mt.first, mt
    return trace(TRACE, BS, limit=200 if quick else None), None


def run_policies(n: int, quick: bool) -> None:
    """Every workload under every policy: hit rate against the ideal, balance, latency."""
    print(f"engines={n} block_size={BS}")
    print(f"{'workload':<14}{'policy':<14}{'hit':>7}{'ideal':>7}{'hit/ideal':>10}"
          f"{'max/mean':>10}{'p90 inst':>10}{'p50 us':>8}{'p99 us':>8}")
    for name in ("shared_prefix", "multi_turn", "trace"):
        cap, budget, max_running = SIZES[name]
        for policy in POLICIES:
            reqs, follow = _workload(name, quick)  # fresh: a run mutates its requests
            res = simulate(reqs, n, RouterSettings(policy=policy, block_size=BS, seed=0, lam=LAM),
                           cap, budget, max_running, follow)
            lat = res.decision_us
            print(f"{name:<14}{policy:<14}{res.hit_rate:>7.3f}{res.ideal_hit_rate:>7.3f}"
                  f"{res.hit_rate / res.ideal_hit_rate:>10.3f}{res.imbalance:>10.3f}"
                  f"{res.imbalance_p90:>10.3f}{percentile(lat, 50):>8.1f}{percentile(lat, 99):>8.1f}")


def decision_latency(n: int, reqs: list[SimRequest], reps: int) -> tuple[float, float, float, int]:
    """route() on the trace with N engines whose index holds what the routed
    requests left there (each request's blocks are stored on its engine; a
    request stays in flight for 16 x N decisions)."""
    router = Router(RouterSettings(block_size=BS, seed=0), n)
    seq = [0] * n
    inflight: deque[str] = deque()
    lat, cpu = [], []
    for rep in range(reps):
        for r in reqs:
            rid = f"{r.rid}.{rep}"
            c0, t0 = time.thread_time_ns(), time.perf_counter()
            d = router.route(rid, r.hashes, r.num_tokens, r.output_len)
            lat.append(time.perf_counter() - t0)
            cpu.append(time.thread_time_ns() - c0)
            seq[d.engine] += 1
            router.on_events(d.engine, KVEvents(1, seq[d.engine], r.hashes))
            inflight.append(rid)
            if len(inflight) > 16 * n:
                router.finish(inflight.popleft())
    a, c = [x * 1e6 for x in lat], [x / 1e3 for x in cpu]
    return percentile(a, 50), percentile(a, 99), percentile(c, 99), router.index.num_entries()


def index_bytes_per_block(reqs: list[SimRequest], n: int = 8) -> tuple[float, int]:
    """tracemalloc's count of what the index allocates per (hash, engine) entry
    (hashes arrive as fresh bytes objects, as decoded from an engine's events)."""
    import tracemalloc

    from conveyor.engine.dp.router.index import PrefixIndex

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex()
    for i, r in enumerate(reqs):
        idx.apply(i % n, KVEvents(1, i // n + 1, [bytes(bytearray(h)) for h in r.hashes]))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / max(idx.num_entries(), 1), idx.num_entries()


def main() -> None:
    """The policy table, the decision latency at 8/64/512 engines, the index's memory."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write-trace", metavar="PATH")
    args = ap.parse_args()
    if args.write_trace:
        write_synthetic_trace(args.write_trace)
        return
    run_policies(args.engines, args.quick)
    reqs = trace(TRACE, BS, limit=200 if args.quick else None)
    print("\ndecision latency (kv_aware, route() only, trace requests)")
    for n in (8, 64, 512):
        p50, p99, cpu99, entries = decision_latency(n, reqs, 1 if args.quick else 3)
        print(f"engines={n:<5} p50={p50:7.1f} us  p99={p99:7.1f} us  (thread CPU time p99={cpu99:7.1f} us)"
              f"  index entries={entries}")
    per, entries = index_bytes_per_block(reqs)
    print(f"\nindex memory: {per:.0f} bytes per (hash, engine) entry over {entries} entries "
          f"(conveyor/engine/dp/router/index.py BYTES_PER_BLOCK)")


if __name__ == "__main__":
    main()
