"""The loads of the resilience scenarios; each drives its scenario's fault
while it runs and returns what the checks and the report read.

- ``poisson``: a reference run (every distinct request at once, undisturbed:
  the outputs every later copy must equal, and the saturated rate), then
  Poisson arrivals at a fraction of that rate for the duration, request i
  repeating body i % unique, with a periodic fault every ``every_s``.
- ``closed``: ``concurrency`` clients in a closed loop until the deadline,
  each request drawn by the fault's mix (valid, dropped mid-stream, invalid);
  the served processes' RSS sampled at the end of warm-up.
- ``phases``: plain streams' TPOT alone, then while the fault (attackers in
  another process) runs.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.lib.proc_tree import rss_kib
from bench.lib.sse import stream
from bench.resilience.targets import System

Sender = Callable[[int, str], Awaitable["Outcome"]]


@dataclass
class Outcome:
    """One request of a poisson load: its body, whether it ended well, its
    output (compared with the reference's) and its (time, tokens) arrivals."""
    body: int
    ok: bool = False
    output: Any = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


@dataclass
class Tally:
    """What the closed load's requests came to, by outcome."""
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    error_events: Counter[str] = field(default_factory=Counter)

    def fail(self, what: str) -> None:
        """Count a failure (the first 20 kept for the report)."""
        self.counts["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(what[:300])


# ---- poisson -------------------------------------------------------------------------------

def _http_bodies(p: dict[str, Any]) -> list[dict[str, Any]]:
    """Random token-id prompts; even bodies greedy, odd ones seeded at 0.8."""
    rng = random.Random(p["seed"])
    out = []
    for i in range(p["unique"]):
        prompt = [rng.randrange(4, 512) for _ in range(p["input_len"])]
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 7000 + i}
        out.append({"prompt": prompt, "max_tokens": p["output_len"], "ignore_eos": True, "logprobs": 0,
                    "stream": True, **sampling})
    return out


def _http_sender(system: System, p: dict[str, Any]) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    import httpx

    bodies = _http_bodies(p)
    client = httpx.AsyncClient(base_url=system.url, headers=system.headers, timeout=600,
                               limits=httpx.Limits(max_connections=512))

    async def send(i: int, rid: str) -> Outcome:
        r = await stream(client, "/v1/completions", bodies[i], full=True)
        ok = r.ok and r.done and bool(r.finish) and all(v == "length" for v in r.finish.values())
        return Outcome(i, ok, (r.text, sum(r.counts)), list(zip(r.times, r.counts)),
                       r.error or ("" if ok else f"finish {r.finish}, done {r.done}"))
    return send, client.aclose


def _engine_sender(system: System, p: dict[str, Any]) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    from bench.lib.prompts import mixed_params, random_prompts

    bodies = list(zip(random_prompts(p["unique"], 64, 192, p["seed"], vocab=512),
                      mixed_params(p["unique"], p["output_len"])))

    async def send(i: int, rid: str) -> Outcome:
        s, toks = Outcome(i), []
        try:
            async for ro in system.llm.generate(bodies[i][0], bodies[i][1], request_id=rid):
                n = sum(len(d.token_ids) for d in ro.outputs)
                for d in ro.outputs:
                    toks += d.token_ids
                if n:
                    s.arrivals.append((time.perf_counter(), n))
            s.ok = True
        except Exception as e:  # noqa: BLE001 - a failed request, counted
            s.error = f"{type(e).__name__}: {e}"
        s.output = tuple(toks)
        return s

    async def close() -> None:
        return None
    return send, close


async def poisson(system: System, p: dict[str, Any], fault: Any, fp: dict[str, Any]) -> dict[str, Any]:
    """Reference run, then Poisson load with ``fault(system, j, rng)`` at
    every ``fp["every_s"]`` seconds (j = 1, 2, ... while the load lasts)."""
    send, close = (_engine_sender if system.kind == "engines" else _http_sender)(system, p)
    try:
        await asyncio.gather(*(send(i, f"w{i}") for i in range(min(4, p["unique"]))))  # warm-up
        t = time.perf_counter()
        ref = list(await asyncio.gather(*(send(i, f"r{i}") for i in range(p["unique"]))))
        wall = time.perf_counter() - t
        if not all(s.ok for s in ref):
            raise SystemExit(f"the undisturbed run failed: {[s.error for s in ref if not s.ok][:3]}")
        sat_rps, sat_tps = len(ref) / wall, sum(s.tokens for s in ref) / wall
        rate = p["load"] * sat_rps
        print(f"saturated: {sat_rps:.2f} req/s, {sat_tps:.0f} tok/s; load at {rate:.2f} req/s", flush=True)
        streams, events, t0 = await _under_fault(system, send, rate, p, fault, fp)
    finally:
        await close()
    return {"ref": ref, "streams": streams, "events": events, "t0": t0, "saturated_req_s": sat_rps,
            "saturated_tok_s": sat_tps, "load_req_s": rate}


async def _under_fault(system: System, send: Sender, rate: float, p: dict[str, Any], fault: Any,
                       fp: dict[str, Any]) -> tuple[list[Outcome], list[dict[str, Any]], float]:
    import json

    rng, events = random.Random(p["seed"]), []
    duration, every = p["duration_s"], fp["every_s"]
    t0 = time.perf_counter()

    async def disrupt() -> None:
        j = 1
        while j * every < duration:  # none as the load stops
            await asyncio.sleep(max(0.0, t0 + j * every - time.perf_counter()))
            at = time.perf_counter()
            ev = await fault(system, j, rng)
            if ev is not None:
                events.append({"t": at, "t_s": round(at - t0, 2), **ev})
                print(json.dumps({k: v for k, v in events[-1].items() if k != "t"}), flush=True)
            j += 1

    task = asyncio.create_task(disrupt())
    tasks, i = [], 0
    while time.perf_counter() - t0 < duration:
        tasks.append(asyncio.create_task(send(i % p["unique"], f"c{i}")))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await task
    streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    return list(streams), events, t0


# ---- closed ---------------------------------------------------------------------------------

async def closed(system: System, p: dict[str, Any], fault: Any, fp: dict[str, Any]) -> dict[str, Any]:
    """``concurrency`` clients, each sending ``fault(client, rng, tally,
    model, fp)`` requests back to back until the deadline or the request cap."""
    duration = p["duration_s"]
    warm_at = min(max(30.0, p["warmup_fraction"] * duration), 120.0, duration)
    model = _model(system)
    tally, rss, budget = Tally(), {}, [p["max_requests"]]
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_client(system, t0 + duration, budget, tally, model,
                                         p["seed"] * 1000 + i, fault, fp)) for i in range(p["concurrency"])]
    await asyncio.sleep(warm_at)
    rss["warm"] = rss_kib(system.pids)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration + 300)
    return {"tally": tally, "wall": time.perf_counter() - t0, "rss": rss, "model": model}


def _model(system: System) -> str:
    """The served model's name (requests name it, as a real client does)."""
    import httpx

    return httpx.get(f"{system.url}/v1/models", headers=system.headers, timeout=30).json()["data"][0]["id"]


async def _client(system: System, deadline: float, budget: list[int], tally: Tally, model: str | None,
                  seed: int, fault: Any, fp: dict[str, Any]) -> None:
    import httpx

    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=system.url, headers=system.headers, timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=1)) as client:
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            tally.counts["sent"] += 1
            try:
                await fault(client, rng, tally, model, fp)
            except Exception as e:  # noqa: BLE001 - a transport failure is a failure here
                tally.fail(f"{type(e).__name__}: {e}")


# ---- phases ---------------------------------------------------------------------------------

async def _tpots(url: str, n: int, seconds: float, tokens: int) -> list[float]:
    """n clients streaming plain completions back to back for ``seconds``;
    each request's TPOT (seconds between its first and last event / events - 1)."""
    import httpx

    body = {"prompt": "The cat sat on the mat and", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    until, tpots = time.monotonic() + seconds, []

    async def one() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while time.monotonic() < until:
                r = await stream(c, "/v1/completions", body)
                if r.ok and len(r.times) > 1:
                    tpots.append((r.times[-1] - r.times[0]) / (len(r.times) - 1))

    await asyncio.gather(*(one() for _ in range(n)))
    return tpots


async def phases(system: System, p: dict[str, Any], fault: Any, fp: dict[str, Any]) -> dict[str, Any]:
    """A 4 s warm-up, the baseline phase, then the attack phase: ``fault``
    (system, fp, seconds) runs beside the plain clients from 1 s before them."""
    await _tpots(system.url, p["clients"], 2.5, p["tokens"])
    base = await _tpots(system.url, p["clients"], p["duration_s"] - 1.5, p["tokens"])
    attack = asyncio.create_task(fault(system, fp, p["duration_s"]))
    await asyncio.sleep(1.0)  # the attack is under way before the measurement starts
    hit = await _tpots(system.url, p["clients"], p["duration_s"] - 1.5, p["tokens"])
    return {"baseline": base, "attack": hit, "attackers": await attack}


LOADS = {"poisson": poisson, "closed": closed, "phases": phases}
