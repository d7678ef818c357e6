#!/usr/bin/env python3
"""Soak test: the served tiny model at saturation for N minutes, with client
disconnects and invalid requests mixed in.

Starts our own Serve app (configs/tiny-cpu.yaml on the bundled demo model,
built into bench/out/demo_model if missing), keeps `--concurrency` requests in
flight (2 x max_num_seqs: saturation) until the time is up, then checks:
- every accepted request ended with a finish_reason on every choice (then
  [DONE]) or an error event, and no error event was sent at all;
- every invalid request got a 4xx in the OpenAI error shape;
- after the load, the engine goes idle: KV usage 0, nothing running, waiting
  or in progress (read from /metrics);
- the RSS of the server processes (replica, engine actor, proxy, controller)
  grew < --max-rss-growth after warm-up (sampled at the end of warm-up and
  once idle at the end).
Prints a summary, writes bench/out/soak.json, exits 1 on any failure.
Loopback only; every loop is bounded by the deadline and a request cap.

  .venv/bin/python bench/soak.py --minutes 10          # the full run
  .venv/bin/python bench/soak.py --minutes 2           # a quick check
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "out")
SERVER_TITLES = (b"ServeReplica", b"EngineCoreActor", b"ProxyActor", b"ServeController")
_FINISH = b'"finish_reason":"'  # only events that finish a choice are parsed

# Each is refused with a 4xx in the OpenAI error shape: (path, raw body).
INVALID: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x"'),
    ("/v1/completions", b'[1, 2]'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}'),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),
    ("/v1/completions", b'{"prompt": [100000]}'),
    ("/v1/completions", b'{"prompt": "x", "n": 100000}'),
    ("/v1/completions", b'{"prompt": "", "max_tokens": 3}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
]
WORDS = ["the cat", "a dog", "runs", "sees the ball", "today.", "日本語の本", "in Zürich.", "😀"]


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    error_events: Counter[str] = field(default_factory=Counter)

    def fail(self, what: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(what[:300])


# ---- requests ---------------------------------------------------------------------

def valid_request(rng: random.Random, model: str | None) -> tuple[str, dict[str, Any], int]:
    """(path, body, number of choices) of one well-formed request."""
    n = 2 if rng.random() < 0.1 else 1
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(8, 96), "n": n,
                            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30),
                            "ignore_eos": rng.random() < 0.8, "stream": rng.random() < 0.9}
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["messages"] = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))}]
        return "/v1/chat/completions", body, n
    if rng.random() < 0.5:
        body["prompt"] = [rng.randrange(10, 500) for _ in range(rng.randint(4, 96))]
    else:
        body["prompt"] = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    return "/v1/completions", body, n


def _is_openai_error(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and isinstance(err["code"], str))


async def send_invalid(client: Any, rng: random.Random, tally: Tally) -> None:
    path, raw = rng.choice(INVALID)
    r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    if 400 <= r.status_code < 500 and _is_openai_error(r.content):
        tally.counts["invalid_refused"] += 1
    else:
        tally.fail(f"invalid {raw[:60]!r} -> {r.status_code} {r.content[:120]!r}")


async def send_valid(client: Any, rng: random.Random, tally: Tally, model: str | None,
                     disconnect: bool) -> None:
    path, body, n = valid_request(rng, model)
    if disconnect:
        body["stream"] = True
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return _refused(tally, r.status_code, r.content)
        tally.counts["accepted"] += 1
        choices = r.json()["choices"]
        if len(choices) == n and all(c["finish_reason"] for c in choices):
            tally.counts["finished"] += 1
        else:
            tally.fail(f"non-stream without a finish_reason: {r.content[:200]!r}")
        return
    leave_after = rng.randint(1, 6) if disconnect else None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return _refused(tally, r.status_code, await r.aread())
        tally.counts["accepted"] += 1
        await _read_stream(r, n, leave_after, tally)


def _refused(tally: Tally, status: int, content: bytes) -> None:
    if status == 429 and _is_openai_error(content):
        tally.counts["backpressure_429"] += 1  # not accepted; allowed, reported
    else:
        tally.fail(f"valid request -> {status} {content[:200]!r}")


async def _read_stream(r: Any, n: int, leave_after: int | None, tally: Tally) -> None:
    finished: set[int] = set()
    events, buf, done, error = 0, b"", False, None
    async for data in r.aiter_bytes():
        *chunks, buf = (buf + data).split(b"\n\n")
        for ev in chunks:
            if not ev.startswith(b"data: "):
                continue
            events += 1
            if ev == b"data: [DONE]":
                done = True
            elif b'"error"' in ev[:20]:
                error = json.loads(ev[6:])["error"].get("code", "?")
            elif _FINISH in ev:
                finished.update(c["index"] for c in json.loads(ev[6:])["choices"]
                                if c.get("finish_reason"))
        if leave_after is not None and events >= leave_after and not done:
            tally.counts["disconnected"] += 1
            return  # leaving the context manager drops the connection mid-stream
    if error is not None:
        tally.error_events[error] += 1
        tally.counts["ended_with_error_event"] += 1
        tally.fail(f"error event {error}")
    elif done and finished == set(range(n)):
        tally.counts["finished"] += 1
    else:
        tally.fail(f"stream ended without finish/[DONE]: finished={sorted(finished)} done={done}")


async def worker(url: str, headers: dict[str, str], deadline: float, budget: list[int],
                 tally: Tally, model: str | None, seed: int, mix: tuple[float, float]) -> None:
    import httpx

    rng = random.Random(seed)
    p_disconnect, p_invalid = mix
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=1)) as client:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            x = rng.random()
            tally.counts["sent"] += 1
            try:
                if x < p_invalid:
                    await send_invalid(client, rng, tally)
                else:
                    await send_valid(client, rng, tally, model, disconnect=x < p_invalid + p_disconnect)
            except Exception as e:  # noqa: BLE001 - a transport failure is a soak failure
                tally.fail(f"{type(e).__name__}: {e}")


# ---- the server side ----------------------------------------------------------------

def server_pids() -> dict[int, str]:
    """The Ray processes that make up the served app, by their process titles."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"ray::") and any(t in cmd for t in SERVER_TITLES):
            out[int(p)] = cmd.split(b"\0")[0].decode(errors="replace")
    return out


def rss_kib(pids: dict[int, str]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                out[pid] = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            out[pid] = 0  # gone: counted as 0, which a growth check will not hide
    return out


def metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith("conveyor:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


IDLE_KEYS = ("conveyor:kv_cache_usage_perc", "conveyor:num_requests_running",
             "conveyor:num_requests_waiting", "conveyor:api_requests_in_progress")


def wait_idle(url: str, headers: dict[str, str], timeout_s: float = 60.0) -> dict[str, float]:
    """Poll until every IDLE_KEYS gauge is 0. The engine publishes stats per
    step, so a 1-token probe makes it step once more."""
    import httpx

    deadline, m = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                   json={"prompt": "x", "max_tokens": 1})
        m = metrics(url, headers)
        if all(m.get(k, 0.0) == 0.0 for k in IDLE_KEYS):
            return m
        time.sleep(0.5)
    return m


def start_server(config: str, overrides: dict[str, Any]) -> str:
    from serve_load import start_server as start

    return start(config, overrides)


# ---- main -------------------------------------------------------------------------------

def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--config", default=os.path.join(REPO, "configs", "tiny-cpu.yaml"))
    p.add_argument("--model", default=os.path.join(OUT, "demo_model"),
                   help="checkpoint dir; the demo model is built there if missing")
    p.add_argument("--port", type=int, default=18556)
    p.add_argument("--concurrency", type=int, default=64, help="in flight (2 x max_num_seqs)")
    p.add_argument("--disconnect-fraction", type=float, default=0.20)
    p.add_argument("--invalid-fraction", type=float, default=0.05)
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="RSS baseline at this fraction of the run (at least 30 s, at most 120 s)")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--max-requests", type=int, default=2_000_000, help="hard cap on requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=os.path.join(OUT, "soak.json"))
    return p.parse_args(argv)


async def run_load(url: str, headers: dict[str, str], a: argparse.Namespace, model: str | None,
                   tally: Tally, on_warm: Any) -> float:
    duration = a.minutes * 60.0
    warm_at = min(max(30.0, a.warmup_fraction * duration), 120.0, duration)
    t0 = time.monotonic()
    budget = [a.max_requests]
    mix = (a.disconnect_fraction, a.invalid_fraction)
    tasks = [asyncio.create_task(worker(url, headers, t0 + duration, budget, tally, model,
                                        a.seed * 1000 + i, mix)) for i in range(a.concurrency)]
    await asyncio.sleep(warm_at)
    await asyncio.get_running_loop().run_in_executor(None, on_warm)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration + 300)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    os.makedirs(OUT, exist_ok=True)
    from conveyor.cluster.demo.model import ensure_demo_model

    ensure_demo_model(a.model)
    url = start_server(a.config, {"model": os.path.abspath(a.model), "serve.port": a.port})
    if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {url}: loopback only")
    key = os.environ.get("CONVEYOR_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    tally, rss = Tally(), {}
    try:
        import httpx
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        pids = server_pids()

        def on_warm() -> None:
            rss["warm"] = rss_kib(pids)

        from serve_load import _run
        wall = _run(run_load(url, headers, a, model, tally, on_warm))
        idle = wait_idle(url, headers)
        rss["end"] = rss_kib(pids)
    finally:
        from serve_load import stop_server
        stop_server()
    return report(a, tally, wall, idle, pids, rss)


def report(a: argparse.Namespace, tally: Tally, wall: float, idle: dict[str, float],
           pids: dict[int, str], rss: dict[str, dict[int, int]]) -> int:
    c = tally.counts
    warm, end = sum(rss["warm"].values()), sum(rss["end"].values())
    growth = end / warm - 1.0 if warm else float("inf")
    checks = {
        "no failures": c["failed"] == 0,
        "every accepted request ended": c["accepted"] == c["finished"] + c["disconnected"],
        "engine idle, KV usage 0": all(idle.get(k, 1.0) == 0.0 for k in IDLE_KEYS),
        f"server RSS growth < {a.max_rss_growth:.0%}": bool(pids) and growth < a.max_rss_growth,
    }
    print(f"soak: {wall:.0f} s, {c['sent']} requests ({c['sent'] / wall:.1f}/s) at concurrency "
          f"{a.concurrency}: {c['accepted']} accepted, {c['finished']} finished, "
          f"{c['disconnected']} disconnected by the client, {c['invalid_refused']} invalid refused "
          f"(4xx), {c['backpressure_429']} x 429, {c['failed']} failed")
    print("after the load: " + ", ".join(f"{k.split(':')[1]}={idle.get(k)}" for k in IDLE_KEYS))
    print(f"server RSS: {warm / 1024:.1f} MiB after warm-up -> {end / 1024:.1f} MiB at the end "
          f"({growth:+.2%}) over {len(pids)} processes")
    for pid, title in sorted(pids.items()):
        print(f"  {pid} {title[:60]}: {rss['warm'].get(pid, 0) / 1024:.1f} -> "
              f"{rss['end'].get(pid, 0) / 1024:.1f} MiB")
    for f in tally.failures:
        print(f"  failure: {f}")
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    with open(a.out_json, "w") as f:
        json.dump({"argv": sys.argv, "git": commit, "platform": platform.platform(),
                   "wall_s": wall, "counts": dict(c), "error_events": dict(tally.error_events),
                   "failures": tally.failures, "idle_metrics": idle, "rss_growth": growth,
                   "rss_kib": {k: {str(p): v for p, v in d.items()} for k, d in rss.items()},
                   "processes": {str(p): t for p, t in pids.items()}, "checks": checks}, f, indent=2)
    print(f"wrote {a.out_json}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
