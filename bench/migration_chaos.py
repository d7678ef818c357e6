#!/usr/bin/env python3
"""Migration chaos (issue 26): --duration seconds of Poisson load on 2
in-process engines (AsyncLLM, data_parallel_size=2, the 30M Llama of
bench/migration.py), and every --every seconds an engine is killed or
drained, alternating, on alternating engines:

- kill: its worker SIGKILLed with parallel.max_restarts 0, so the engine is
  lost: its requests move to the other engine at once and a new engine
  replaces it in the background (DataParallelClient.replace_engine);
- drain: its requests are handed over (parallel.paced_drain), then it takes
  requests again (undrain).

First an undisturbed run of the --unique request bodies all at once gives
the reference outputs and the saturated request rate; the load then arrives
at --load x that rate, request i reusing body i % --unique. Passes when no
request fails and every output equals its reference. Writes
bench/out/migration_chaos.json and a throughput-over-time PNG with the
events marked (bench/png_plot.py: no matplotlib needed).

  .venv/bin/python bench/migration_chaos.py                       # 3 minutes, an event every 30 s
  .venv/bin/python bench/migration_chaos.py --duration 40 --every 10
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)
OUT = os.path.join(REPO, "bench", "out")
KILL, DRAIN = (214, 39, 40), (44, 160, 44)


@dataclass
class Stream:
    body: int
    tokens: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    error: str = ""


async def one(llm, body: tuple[list[int], object], s: Stream, rid: str) -> Stream:
    try:
        async for ro in llm.generate(body[0], body[1], request_id=rid):
            n = sum(len(d.token_ids) for d in ro.outputs)
            for d in ro.outputs:
                s.tokens += d.token_ids
            if n:
                s.arrivals.append((time.monotonic(), n))
    except Exception as e:  # noqa: BLE001 - a failed request, counted
        s.error = f"{type(e).__name__}: {e}"
    return s


async def _wait_state(dp, k: int, state: str, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while dp.states[k] != state:
        if time.monotonic() > end:
            raise TimeoutError(f"engine {k} never became {state}: {dp.states}")
        await asyncio.sleep(0.02)


async def event(llm, kind: str, k: int) -> dict:
    """Kill or drain engine k; returns what happened (seconds, requests moved)."""
    dp, loop, t = llm.client, asyncio.get_running_loop(), time.monotonic()
    before = sum(dp.migrations.moved.values())
    if kind == "kill":
        os.kill(dp.clients[k].worker_pids()[0], signal.SIGKILL)
        await _wait_state(dp, k, "dead")
        lost_s = time.monotonic() - t
        await loop.run_in_executor(None, dp.replace_engine, k)
        out = {"lost_after_s": round(lost_s, 2), "replaced_after_s": round(time.monotonic() - t, 2)}
    else:
        await llm.drain(k, timeout_s=120)
        out = {"handover_s": round(time.monotonic() - t, 2)}
        llm.undrain(k)
    return {"kind": kind, "engine": k, "moved": sum(dp.migrations.moved.values()) - before, **out}


async def chaos(llm, bodies, rate: float, a: argparse.Namespace) -> tuple[list[Stream], list[dict], float]:
    rng = random.Random(a.seed)
    events: list[dict] = []
    t0 = time.monotonic()

    async def disrupt() -> None:
        for j in range(1, math.ceil(a.duration / a.every)):  # none as the load stops
            await asyncio.sleep(t0 + j * a.every - time.monotonic())
            kind, k = ("kill", "drain")[(j - 1) % 2], ((j - 1) // 2) % 2
            at = time.monotonic() - t0
            ev = await event(llm, kind, k)
            events.append({"t_s": round(at, 2), **ev})
            print(json.dumps(events[-1]), flush=True)

    task = asyncio.create_task(disrupt())
    tasks, i = [], 0
    while time.monotonic() - t0 < a.duration:
        b = i % len(bodies)
        tasks.append(asyncio.create_task(one(llm, bodies[b], Stream(b), f"c{i}")))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await task
    return list(await asyncio.gather(*tasks)), events, t0


def series(streams: list[Stream], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    bins: dict[int, int] = {}
    for s in streams:
        for t, n in s.arrivals:
            k = int((t - t0) // bin_s)
            bins[k] = bins.get(k, 0) + n
    last = max(bins, default=0)
    return [k * bin_s for k in range(last + 1)], [bins.get(k, 0) / bin_s for k in range(last + 1)]


async def main_async(a: argparse.Namespace) -> dict:
    from bench.migration import _params, _prompts
    from bench.structured_output import build_model
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    path = build_model(os.path.join(a.model_dir, "llama30m_v512"))
    cfg = build_config(model=path, max_model_len=1024, data_parallel_size=2, max_num_seqs=128,
                       num_gpu_blocks=128 * 20, **{"parallel.max_restarts": 0})
    bodies = list(zip(_prompts(a.unique, a.seed), _params(a.unique, a.max_tokens)))
    llm = AsyncLLM(cfg)
    try:
        t = time.monotonic()
        ref = await asyncio.gather(*(one(llm, b, Stream(i), f"r{i}") for i, b in enumerate(bodies)))
        sat_rps = len(ref) / (time.monotonic() - t)
        if any(s.error for s in ref):
            raise SystemExit(f"the undisturbed run failed: {[s.error for s in ref if s.error][:3]}")
        rate = a.load * sat_rps
        print(f"saturated {sat_rps:.2f} req/s; chaos at {rate:.2f} req/s", flush=True)
        streams, events, t0 = await chaos(llm, bodies, rate, a)
        metrics = llm.client.metrics()
    finally:
        await llm.shutdown()
    failed = [s for s in streams if s.error]
    changed = [s for s in streams if not s.error and s.tokens != ref[s.body].tokens]
    xs, ys = series(streams, t0)
    wall = max((t for s in streams for t, _ in s.arrivals), default=t0) - t0
    return {"requests": len(streams), "failed": len(failed), "changed": len(changed),
            "failures": [s.error for s in failed[:3]], "events": events,
            "saturated_req_s": round(sat_rps, 2), "load_req_s": round(rate, 2),
            "tok_s_mean": round(sum(len(s.tokens) for s in streams) / wall, 1) if wall > 0 else 0.0,
            "reprefill_tokens": sum(v for k, v in metrics.items() if "reprefill" in k),
            "tok_s_per_second": ys, "t0_series": xs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--every", type=float, default=30.0)
    p.add_argument("--unique", type=int, default=48, help="distinct request bodies")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--load", type=float, default=0.8, help="fraction of the saturated request rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "conveyor-bench-models"))
    p.add_argument("--out-json", default=os.path.join(OUT, "migration_chaos.json"))
    p.add_argument("--out-png", default=os.path.join(OUT, "migration_chaos.png"))
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    from png_plot import line_chart

    xs, ys = res.pop("t0_series"), res["tok_s_per_second"]
    line_chart(a.out_png, xs, ys, [(e["t_s"], KILL if e["kind"] == "kill" else DRAIN) for e in res["events"]],
               title=f"2 engines, {a.load:g} x saturated load: an engine killed or drained every {a.every:g} s",
               xlabel="seconds", ylabel="output tokens/s (1 s bins)",
               legend=[("engine killed", KILL), ("engine drained", DRAIN)])
    meta = {"argv": sys.argv, "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(a.out_json)), exist_ok=True)
    with open(a.out_json, "w") as f:
        json.dump({"meta": meta, "summary": res}, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "tok_s_per_second"}, indent=1))
    print(f"wrote {a.out_json} and {a.out_png}")
    if res["failed"] or res["changed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
