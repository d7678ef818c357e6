"""The checks of the resilience scenarios: each reads the run's summary
(bench/resilience/report.py) while the system is still up, may measure it
once more (the idle engine, the RSS at the end), and returns (label, passed).
"""
from __future__ import annotations

import time
from typing import Any

from bench.lib.sse import metrics
from bench.resilience.report import end_rss
from bench.resilience.targets import System

IDLE_KEYS = ("conveyor:kv_cache_usage_perc", "conveyor:num_requests_running",
             "conveyor:num_requests_waiting", "conveyor:api_requests_in_progress")
Check = tuple[str, bool]


def no_failures(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """No request failed (an HTTP error, an error event, a lost stream, an exception)."""
    return "no request failed", s["failed"] == 0


def same_as_reference(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """Every output equals the undisturbed run's for the same body (greedy and seeded)."""
    return "every output equals the undisturbed run's", s["mismatched"] == 0


def restart_per_kill(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """The engine restarted once per kill (conveyor:engine_restarts_total)."""
    return f"one engine restart per kill ({s['kills']} kills)", s["kills"] == s.get("engine_restarts")


def every_accepted_ended(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """Every accepted request finished (every choice, then [DONE]) or was left by its client."""
    c = s["counts"]
    return "every accepted request ended", c.get("accepted", 0) == c.get("finished", 0) + c.get("disconnected", 0)


def engine_idle(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """After the load the engine goes idle: KV usage 0, nothing running, waiting
    or in progress. The engine publishes stats per step, so a 1-token probe
    makes it step once more; polled for up to 60 s."""
    import httpx

    deadline, m = time.monotonic() + 60.0, {}
    while time.monotonic() < deadline:
        httpx.post(f"{system.url}/v1/completions", headers=system.headers, timeout=30,
                   json={"prompt": "x", "max_tokens": 1})
        m = metrics(system.url, system.headers)
        if all(m.get(k, 0.0) == 0.0 for k in IDLE_KEYS):
            break
        time.sleep(0.5)
    s["idle_metrics"] = {k: m.get(k) for k in IDLE_KEYS}
    print("after the load: " + ", ".join(f"{k.split(':')[1]}={m.get(k)}" for k in IDLE_KEYS))
    return "engine idle, KV usage 0", all(m.get(k, 1.0) == 0.0 for k in IDLE_KEYS)


def rss_growth(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """The served processes' RSS grew less than max_rss_growth from the end
    of warm-up to the end (a leak shows as steady growth)."""
    warm, end = s["rss_warm_kib"], end_rss(s, system)
    w, e = sum(warm.values()), sum(end.values())
    s["rss_growth"] = growth = e / w - 1.0 if w else float("inf")
    print(f"server RSS: {w / 1024:.1f} MiB after warm-up -> {e / 1024:.1f} MiB at the end "
          f"({growth:+.2%}) over {len(system.pids)} processes")
    for pid, title in sorted(system.pids.items()):
        print(f"  {pid} {title[:60]}: {warm.get(pid, 0) / 1024:.1f} -> {end.get(pid, 0) / 1024:.1f} MiB")
    limit = cp["max_rss_growth"]
    return f"server RSS growth < {limit:.0%}", bool(system.pids) and growth < limit


def tpot_ratio(s: dict[str, Any], system: System, cp: dict[str, Any]) -> Check:
    """Hostile requests do not slow everyone else: median TPOT under attack
    at most max_tpot_ratio x the baseline's (issue 31's acceptance)."""
    limit = cp["max_tpot_ratio"]
    return f"TPOT under attack <= {limit} x baseline (median)", s["ratio_median"] <= limit


CHECKS = {f.__name__: f for f in (no_failures, same_as_reference, restart_per_kill, every_accepted_ended,
                                  engine_idle, rss_growth, tpot_ratio)}
