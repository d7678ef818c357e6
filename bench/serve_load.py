#!/usr/bin/env python3
"""Load generator for the OpenAI endpoint (names as `vllm bench serve`).

Streams /v1/completions requests with random token-id prompts (exact input
length) and `ignore_eos` (exact output length), at Poisson arrival rates or a
fixed concurrency, bounded in count and time, to loopback only. Token counts
come from the usage chunk. Reports request throughput, output tokens/s,
TTFT / TPOT / ITL / E2E mean, p50, p90, p99 and goodput under SLOs, writes
JSON and a PNG. `--offline` measures the same prompts through LLM.generate
(the upper bound), after the server is gone, so two engines never overlap.

  # start our own Serve app from an engine config, 3 rates + offline:
  .venv/bin/python bench/serve_load.py --config configs/tiny-cpu.yaml \
      --model bench/out/tiny-llama --make-tiny --rates 5,20,inf --offline
  # an already running server:
  .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8000 --rates 10
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
OUT = os.path.join(REPO, "bench", "out")
_USAGE = re.compile(rb'"usage":\s*\{')  # the usage chunk (null usage elsewhere is not it)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# ---- one request ----------------------------------------------------------------------

async def one_request(client: Any, body: dict[str, Any]) -> Result:
    """One streamed request. Only the usage and error events are parsed as
    JSON; a content event is just timestamped, so the client (which shares the
    machine with the server) spends little CPU per event."""
    start = time.perf_counter()
    last, res, buf = start, Result(ok=False), b""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for data in r.aiter_bytes():
                now = time.perf_counter()
                *events, buf = (buf + data).split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                        continue
                    if b'"error"' in ev or _USAGE.search(ev):
                        obj = json.loads(ev[6:])
                        if "error" in obj:
                            return Result(ok=False, error=str(obj["error"].get("message")))
                        if obj.get("usage"):
                            res.prompt_tokens = obj["usage"]["prompt_tokens"]
                            res.output_tokens = obj["usage"]["completion_tokens"]
                        if not obj.get("choices"):
                            continue
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e, res.ok = time.perf_counter() - start, True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, bodies: list[dict[str, Any]], rate: float, concurrency: int | None,
                   duration_s: float, api_key: str | None, seed: int) -> tuple[list[Result], float]:
    """Issue requests at Poisson `rate` (inf: all at once), at most
    `concurrency` in flight, stop issuing after `duration_s`."""
    import httpx

    host = urlparse(url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit(f"refusing to load {host}: loopback targets only")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # One single-connection client per in-flight slot: a shared httpx pool
    # scans every connection on each request, which cost the load generator
    # more CPU than the requests themselves (it shares the cores with the server).
    # All made before the clock starts, sharing one SSL context (building one
    # per client costs ~17 ms of event-loop time each).
    ssl_ctx = httpx.create_ssl_context()
    # No per-read timeout: httpcore arms a timer for every read, which was a fifth
    # of the client's CPU; run_load's wait_for bounds the whole run instead.
    timeout = httpx.Timeout(300.0, read=None)
    made = [httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, verify=ssl_ctx,
                              limits=httpx.Limits(max_connections=1))
            for _ in range(min(concurrency or len(bodies), len(bodies)))]
    idle: asyncio.Queue[Any] = asyncio.Queue()
    for c in made:
        idle.put_nowait(c)
    rng = random.Random(seed)

    async def gated(b: dict[str, Any]) -> Result:
        c = await idle.get()
        try:
            return await one_request(c, b)
        finally:
            idle.put_nowait(c)

    try:
        t0, tasks = time.perf_counter(), []
        for b in bodies:
            if time.perf_counter() - t0 > duration_s:
                break
            tasks.append(asyncio.create_task(gated(b)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration_s + 300)
    finally:
        for c in made:
            await c.aclose()
    return list(results), time.perf_counter() - t0


# ---- statistics -----------------------------------------------------------------------

def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    s: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tok,
        "request_throughput": len(ok) / wall, "output_throughput": out_tok / wall,
        "total_token_throughput": (out_tok + sum(r.prompt_tokens for r in ok)) / wall,
        "errors": sorted({r.error for r in results if not r.ok})[:5]}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}
    for name, xs in series.items():
        ms = [x * 1000 for x in xs]
        s[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else 0.0
        for p in (50, 90, 99):
            s[f"p{p}_{name}_ms"] = _pct(ms, p)
    if slos:
        good = [r for r in ok if all(_metric_ms(r, k) <= v for k, v in slos.items())]
        s["request_goodput"] = len(good) / wall
    return s


def _metric_ms(r: Result, key: str) -> float:
    return {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}[key] * 1000


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for it in items:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {it!r}")
        slos[k] = float(v)
    return slos


# ---- prompts, server, offline ------------------------------------------------------

def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]


def bodies_for(prompts: list[list[int]], output_len: int, model: str | None) -> list[dict[str, Any]]:
    return [{"model": model, "prompt": p, "max_tokens": output_len, "ignore_eos": True,
             "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            for p in prompts]


def start_server(config: str, overrides: dict[str, Any], direct: bool = False) -> str:
    """Our own Serve app; direct: Ray Serve direct ingress, and the URL returned
    is the replica's own (no proxy hop)."""
    import ray

    from conveyor.cluster.serve_app import direct_ingress_urls, enable_direct_ingress, run_serve

    if direct:
        enable_direct_ingress()
        overrides = {**overrides, "serve.direct_ingress": True}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    url = run_serve(config, blocking=False, overrides=overrides)
    if direct:
        urls = direct_ingress_urls("conveyor", urlparse(url).hostname or "127.0.0.1")
        if not urls:
            raise SystemExit("direct ingress is on but no replica port was found")
        url = urls[0]
    return url


def _run(coro: Any) -> Any:
    """asyncio.run on uvloop when it is installed (Ray brings it): the client
    shares the cores with the server, so its own loop overhead counts."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def parse_sets(items: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE ... -> overrides; values are YAML scalars (50, false, 1.5)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def stop_server() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_offline(config: str, overrides: dict[str, Any], prompts: list[list[int]],
                output_len: int, threads: int) -> dict[str, Any]:
    """LLM.generate on the same prompts. `threads`: torch intra-op threads, by
    default 1 = what the Serve replica gets (Ray sets OMP_NUM_THREADS from the
    actor's num_cpus=1), so both sides run the model alike. (Two OpenMP threads
    on a 2-core machine that is busy with anything else slow a tiny model down
    by 10x or more: the threads spin at every barrier.)"""
    import torch

    from conveyor.engine import LLM, SamplingParams

    torch.set_num_threads(threads)

    llm = LLM.from_config(config, **overrides)
    try:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"completed": len(outs), "duration_s": wall, "total_output_tokens": out_tok,
            "request_throughput": len(outs) / wall, "output_throughput": out_tok / wall}


def plot(runs: list[dict[str, Any]], offline: dict[str, Any] | None, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in runs]
    x = range(len(runs))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.bar(x, [r["output_throughput"] for r in runs], color="tab:blue", label="serving")
    if offline:
        ax.axhline(offline["output_throughput"], color="tab:red", ls="--", label="offline LLM.generate")
    ax.set(title="output tokens/s", xticks=list(x), xticklabels=labels)
    ax.legend()
    for ax, key, name in ((axes[0][1], "ttft", "TTFT"), (axes[1][0], "tpot", "TPOT / ITL"),
                          (axes[1][1], "e2el", "E2E latency")):
        for p, style in ((50, "-o"), (90, "--s"), (99, ":^")):
            ax.plot(list(x), [r[f"p{p}_{key}_ms"] for r in runs], style, label=f"{key} p{p}")
        if key == "tpot":
            ax.plot(list(x), [r["p99_itl_ms"] for r in runs], "-.x", label="itl p99")
        ax.set(title=f"{name} (ms)", xticks=list(x), xticklabels=labels)
        ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("request rate (req/s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# ---- main -----------------------------------------------------------------------------

def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="target an already running server (loopback only)")
    src.add_argument("--config", help="engine YAML: start our own Serve app from it")
    p.add_argument("--model", help="override the config's model path")
    p.add_argument("--port", type=int, default=None, help="override the config's serve.port")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="server-side serve.stream_interval: SSE every N tokens per choice "
                        "(our own server only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="engine config override for our own server, e.g. parallel.engine_actor=false")
    p.add_argument("--direct-ingress", action="store_true",
                   help="our own server with Ray Serve direct ingress; load its replica port")
    p.add_argument("--make-tiny", action="store_true",
                   help="build the tests' tiny Llama checkpoint at --model if it is missing")
    p.add_argument("--rates", default="5,20,inf", help="comma-separated req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=120.0, help="stop issuing after this")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=500, help="prompt token ids are drawn below this")
    p.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"], help="SLOs KEY:MS")
    p.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"))
    p.add_argument("--offline", action="store_true", help="also measure LLM.generate (needs --config)")
    p.add_argument("--offline-threads", type=int, default=1, help="torch threads for --offline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=os.path.join(OUT, "serve_load.json"))
    p.add_argument("--out-png", default=os.path.join(OUT, "serve_load.png"))
    a = p.parse_args(argv)
    if a.offline and not a.config:
        p.error("--offline needs --config")
    return a


def _model_name(url: str, api_key: str | None) -> str | None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    return r.json()["data"][0]["id"] if r.status_code == 200 else None


def _print_run(label: str, s: dict[str, Any]) -> None:
    print(f"rate {label:>5}: {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f}s | "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} out tok/s | "
          f"TTFT p50/p90/p99 {s['p50_ttft_ms']:.0f}/{s['p90_ttft_ms']:.0f}/{s['p99_ttft_ms']:.0f} ms | "
          f"TPOT p50/p99 {s['p50_tpot_ms']:.1f}/{s['p99_tpot_ms']:.1f} ms | "
          f"ITL p99 {s['p99_itl_ms']:.1f} ms | E2E p50/p99 {s['p50_e2el_ms']:.0f}/{s['p99_e2el_ms']:.0f} ms"
          + (f" | goodput {s['request_goodput']:.2f} req/s" if "request_goodput" in s else ""))


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    os.makedirs(OUT, exist_ok=True)
    overrides = {"model": os.path.abspath(a.model)} if a.model else {}
    if a.make_tiny and a.model and not os.path.isdir(a.model):
        sys.path.insert(0, os.path.join(REPO, "tests", "cpu"))
        from llm_utils import make_checkpoint
        make_checkpoint("llama", a.model)
    slos = parse_slos(a.goodput)
    prompts = make_prompts(a.num_prompts, a.input_len, a.vocab_size, a.seed)
    rates = [float(r) for r in a.rates.split(",")]
    serve_overrides = {**overrides, **({"serve.port": a.port} if a.port else {}),
                       **parse_sets(a.set),
                       **({"serve.stream_interval": a.stream_interval} if a.stream_interval else {})}
    url = a.url or start_server(a.config, serve_overrides, a.direct_ingress)
    runs = []
    try:
        model = _model_name(url, a.api_key)
        _run(run_load(url, bodies_for(prompts[:8], 8, model), math.inf, None, 60, a.api_key, 0))
        for rate in rates:
            results, wall = _run(run_load(url, bodies_for(prompts, a.output_len, model), rate,
                                                 a.max_concurrency, a.duration_s, a.api_key, a.seed))
            label = "inf" if math.isinf(rate) else f"{rate:g}"
            s = {"label": label, "rate": rate, **summarize(results, wall, slos)}
            _print_run(s["label"], s)
            runs.append(s)
    finally:
        if a.config:
            stop_server()
    offline = None
    if a.offline:
        offline = run_offline(a.config, overrides, prompts, a.output_len, a.offline_threads)
    if offline:
        best = max(r["output_throughput"] for r in runs)
        offline["serving_over_offline_at_saturation"] = best / offline["output_throughput"]
        print(f"offline LLM.generate: {offline['request_throughput']:.2f} req/s, "
              f"{offline['output_throughput']:.0f} out tok/s; serving/offline at saturation "
              f"{offline['serving_over_offline_at_saturation']:.1%}")
    meta = {"argv": sys.argv, "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "slos_ms": slos, "num_prompts": a.num_prompts,
            "input_len": a.input_len, "output_len": a.output_len}
    with open(a.out_json, "w") as f:
        json.dump({"meta": meta, "runs": runs, "offline": offline}, f, indent=2)
    plot(runs, offline, a.out_png, f"serving, {a.input_len} in / {a.output_len} out tokens, "
                                   f"{a.num_prompts} prompts")
    print(f"wrote {a.out_json} and {a.out_png}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
