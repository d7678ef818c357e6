"""What a resilience run measured, per load: the numbers its checks read,
the printed summary, the JSON result and (poisson loads) the throughput
curve with the faults marked.
"""
from __future__ import annotations

import json
import statistics
from typing import Any

from bench.lib.png_plot import line_chart
from bench.lib.proc_tree import rss_kib
from bench.lib.sse import metrics
from bench.lib.stats import percentile, rate_series
from bench.resilience.load import Outcome
from bench.resilience.targets import System

KILL, DRAIN, SATURATED = (214, 39, 40), (44, 160, 44), (150, 150, 150)


def recovery_times(streams: list[Outcome], events: list[dict[str, Any]], window_s: float = 60.0) -> list[float]:
    """Per kill: seconds from the kill to the end of the longest pause in
    token arrivals (any stream) after it, within window_s and before the next
    event: the rebuild's stall as users see it. (The first token after a kill
    is no measure: the outputs of steps finished before the death still arrive.)"""
    arrivals = sorted(t for s in streams for t, _ in s.arrivals)
    out = []
    for j, ev in enumerate(events):
        if ev["kind"] != "kill":
            continue
        t_kill = ev["t"]
        until = min(t_kill + window_s, events[j + 1]["t"] if j + 1 < len(events) else float("inf"))
        after = [t_kill] + [t for t in arrivals if t_kill < t <= until]
        if len(after) < 2:
            out.append(float("inf"))
            continue
        end = max(range(1, len(after)), key=lambda k: after[k] - after[k - 1])
        out.append(after[end] - t_kill)
    return out


def _engine_recovery(system: System) -> dict[str, float]:
    """(restarts, mean rebuild seconds) of a served engine, from /metrics."""
    m = metrics(system.url, system.headers)
    n = m.get("conveyor:engine_recovery_seconds_count", 0.0)
    return {"engine_restarts": m.get("conveyor:engine_restarts_total", 0.0),
            "engine_rebuild_s_mean": m.get("conveyor:engine_recovery_seconds_sum", 0.0) / n if n else 0.0}


def summarize_poisson(res: dict[str, Any], system: System) -> dict[str, Any]:
    """Failures, outputs against the reference, recovery per kill, throughput."""
    streams, ref, t0 = res["streams"], res["ref"], res["t0"]
    failed = [s for s in streams if not s.ok]
    mismatched = [s for s in streams if s.ok and s.output != ref[s.body].output]
    rec = recovery_times(streams, res["events"])
    wall = max((t for s in streams for t, _ in s.arrivals), default=t0) - t0
    xs, ys = rate_series((a for s in streams for a in s.arrivals), t0)
    out: dict[str, Any] = {
        "requests": len(streams), "failed": len(failed), "mismatched": len(mismatched),
        "failures": [s.error for s in failed[:5]],
        "events": [{k: v for k, v in e.items() if k != "t"} for e in res["events"]],
        "kills": sum(e["kind"] == "kill" for e in res["events"]),
        "recovery_s": rec, "recovery_s_p50": statistics.median(rec) if rec else None,
        "recovery_s_max": max(rec) if rec else None,
        "saturated_req_s": round(res["saturated_req_s"], 2), "saturated_tok_s": round(res["saturated_tok_s"], 1),
        "load_req_s": round(res["load_req_s"], 2),
        "tok_s_mean": round(sum(s.tokens for s in streams) / wall, 1) if wall > 0 else 0.0,
        "tok_s_per_second": ys, "seconds": xs}
    if system.kind == "engines":
        from conveyor.engine.core_client import metric_dict

        rows = metric_dict(system.llm.client.metric_rows())
        out["reprefill_tokens"] = sum(v for k, v in rows.items() if "reprefill" in k)
    elif system.url:
        out.update(_engine_recovery(system))
    return out


def summarize_closed(res: dict[str, Any], system: System) -> dict[str, Any]:
    """The tally of the closed load (the idle and RSS checks add theirs)."""
    t = res["tally"]
    return {"wall_s": res["wall"], "counts": dict(t.counts), "failed": t.counts["failed"],
            "error_events": dict(t.error_events), "failures": t.failures, "rss_warm_kib": res["rss"]["warm"],
            "processes": system.pids}


def _tpot(tpots: list[float]) -> dict[str, float]:
    return {"requests": len(tpots), "tpot_median_ms": statistics.median(tpots) * 1e3 if tpots else 0.0,
            "tpot_p90_ms": percentile(tpots, 90) * 1e3}


def summarize_phases(res: dict[str, Any], system: System) -> dict[str, Any]:
    """Both phases' TPOT, their ratio, the attackers' status codes."""
    b, a = _tpot(res["baseline"]), _tpot(res["attack"])
    return {"baseline": b, "attack": a, "failed": 0, "attackers": res["attackers"],
            "ratio_median": a["tpot_median_ms"] / b["tpot_median_ms"] if b["tpot_median_ms"] else float("inf"),
            "ratio_p90": a["tpot_p90_ms"] / b["tpot_p90_ms"] if b["tpot_p90_ms"] else float("inf")}


SUMMARIES = {"poisson": summarize_poisson, "closed": summarize_closed, "phases": summarize_phases}


def end_rss(summary: dict[str, Any], system: System) -> dict[int, int]:
    """The served processes' RSS now (once, after the idle check when it ran)."""
    if "rss_end_kib" not in summary:
        summary["rss_end_kib"] = rss_kib(system.pids)
    return summary["rss_end_kib"]


def show(load: str, s: dict[str, Any]) -> None:
    """Print the summary the way its load reads best."""
    if load == "closed":
        c = s["counts"]
        print(f"{s['wall_s']:.0f} s, {c.get('sent', 0)} requests ({c.get('sent', 0) / s['wall_s']:.1f}/s): "
              f"{c.get('accepted', 0)} accepted, {c.get('finished', 0)} finished, {c.get('disconnected', 0)} "
              f"disconnected by the client, {c.get('invalid_refused', 0)} invalid refused (4xx), "
              f"{c.get('backpressure_429', 0)} x 429, {c.get('failed', 0)} failed")
        for f in s["failures"]:
            print(f"  failure: {f}")
        return
    hidden = ("tok_s_per_second", "seconds", "recovery_s")
    print(json.dumps({k: v for k, v in s.items() if k not in hidden}, indent=1, default=str))
    if s.get("recovery_s"):
        print(f"recovery per kill (s): {', '.join(f'{x:.1f}' for x in s['recovery_s'])}")


def plot(path: str, name: str, s: dict[str, Any]) -> None:
    """A poisson run's output tokens/s over time, faults marked, saturation dotted."""
    events = [(e["t_s"], KILL if e["kind"] == "kill" else DRAIN) for e in s["events"]]
    line_chart(path, s["seconds"], s["tok_s_per_second"], events, title=f"{name}: output tokens/s over time",
               xlabel="seconds", ylabel="output tokens/s (1 s bins)",
               legend=[("kill", KILL), ("drain", DRAIN), (f"saturated {s['saturated_tok_s']:.0f} tok/s", SATURATED)],
               hlines=[(s["saturated_tok_s"], SATURATED)])
