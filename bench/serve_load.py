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
import random
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.launch import parse_sets, serve_in_process, stop_in_process  # noqa: E402
from bench.lib.meta import run_meta  # noqa: E402
from bench.lib.sse import Reply, auth_headers, loopback_only, model_name, run, stream  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402

OUT = os.path.join(REPO, "bench", "out")


# ---- the load ---------------------------------------------------------------------------

async def run_load(url: str, bodies: list[dict[str, Any]], rate: float, concurrency: int | None,
                   duration_s: float, api_key: str | None, seed: int) -> tuple[list[Reply], float]:
    """Issue requests at Poisson `rate` (inf: all at once), at most
    `concurrency` in flight, stop issuing after `duration_s`."""
    import httpx

    loopback_only(url)
    # One single-connection client per in-flight slot: a shared httpx pool
    # scans every connection on each request, which cost the load generator
    # more CPU than the requests themselves (it shares the cores with the server).
    # All made before the clock starts, sharing one SSL context (building one
    # per client costs ~17 ms of event-loop time each).
    ssl_ctx = httpx.create_ssl_context()
    # No per-read timeout: httpcore arms a timer for every read, which was a fifth
    # of the client's CPU; run_load's wait_for bounds the whole run instead.
    timeout = httpx.Timeout(300.0, read=None)
    made = [httpx.AsyncClient(base_url=url, headers=auth_headers(api_key), timeout=timeout, verify=ssl_ctx,
                              limits=httpx.Limits(max_connections=1))
            for _ in range(min(concurrency or len(bodies), len(bodies)))]
    idle: asyncio.Queue[Any] = asyncio.Queue()
    for c in made:
        idle.put_nowait(c)
    rng = random.Random(seed)

    async def gated(b: dict[str, Any]) -> Reply:
        c = await idle.get()
        try:
            return await stream(c, "/v1/completions", b)
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

def summarize(results: list[Reply], wall: float, slos: dict[str, float]) -> dict[str, Any]:
    """`vllm bench serve`'s metrics of one run: throughputs, TTFT / TPOT /
    ITL / E2E mean and p50/p90/p99 in ms, goodput under the SLOs."""
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
            s[f"p{p}_{name}_ms"] = percentile(ms, p)
    if slos:
        good = [r for r in ok if all(_metric_ms(r, k) <= v for k, v in slos.items())]
        s["request_goodput"] = len(good) / wall
    return s


def _metric_ms(r: Reply, key: str) -> float:
    return {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}[key] * 1000


def parse_slos(items: list[str]) -> dict[str, float]:
    """--goodput KEY:MS ... -> {ttft|tpot|e2el: ms}."""
    slos = {}
    for it in items:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {it!r}")
        slos[k] = float(v)
    return slos


# ---- prompts, server, offline ------------------------------------------------------

def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of exactly input_len ids in 10..vocab-1 (exact lengths, as `vllm bench serve`)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(n)]


def bodies_for(prompts: list[list[int]], output_len: int, model: str | None) -> list[dict[str, Any]]:
    """Streamed greedy completions of exactly output_len tokens, usage chunk on."""
    return [{"model": model, "prompt": p, "max_tokens": output_len, "ignore_eos": True,
             "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            for p in prompts]


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
    """Output tok/s (and the offline line) and the TTFT / TPOT / E2E
    percentiles against the request rate, four panels in one PNG."""
    from bench.lib.png_plot import Chart, Series, save_charts

    labels = [r["label"] for r in runs]
    x = list(range(len(runs)))
    tput = Chart(f"output tok/s; {title}", "request rate (req/s)", "tok/s",
                 [Series("serving", x, [r["output_throughput"] for r in runs])],
                 hlines=[(offline["output_throughput"], (214, 39, 40))] if offline else [],
                 legend=[("offline llm.generate", (214, 39, 40))] if offline else [], categories=labels)
    charts = [tput]
    for key, name in (("ttft", "ttft"), ("tpot", "tpot / itl"), ("e2el", "e2e latency")):
        series = [Series(f"{key} p{p}", x, [r[f"p{p}_{key}_ms"] for r in runs]) for p in (50, 90, 99)]
        if key == "tpot":
            series.append(Series("itl p99", x, [r["p99_itl_ms"] for r in runs]))
        charts.append(Chart(f"{name} (ms)", "request rate (req/s)", "ms", series, categories=labels))
    save_charts(path, charts, cols=2, w=700, h=400)


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
                   help="build the tiny Llama checkpoint (bench/lib/models.py, \"tiny\") at --model unless it is there")
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


def _print_run(label: str, s: dict[str, Any]) -> None:
    print(f"rate {label:>5}: {s['completed']} ok / {s['failed']} failed in {s['duration_s']:.1f}s | "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} out tok/s | "
          f"TTFT p50/p90/p99 {s['p50_ttft_ms']:.0f}/{s['p90_ttft_ms']:.0f}/{s['p99_ttft_ms']:.0f} ms | "
          f"TPOT p50/p99 {s['p50_tpot_ms']:.1f}/{s['p99_tpot_ms']:.1f} ms | "
          f"ITL p99 {s['p99_itl_ms']:.1f} ms | E2E p50/p99 {s['p50_e2el_ms']:.0f}/{s['p99_e2el_ms']:.0f} ms"
          + (f" | goodput {s['request_goodput']:.2f} req/s" if "request_goodput" in s else ""))


def main(argv: list[str] | None = None) -> int:
    """Load the server at each rate (after a warm-up), then --offline; write JSON and PNG."""
    a = _args(argv)
    os.makedirs(OUT, exist_ok=True)
    overrides = {"model": os.path.abspath(a.model)} if a.model else {}
    if a.make_tiny and a.model:  # built when missing or built from another spec
        from bench.lib.models import model_dir

        model_dir("tiny", a.model)
    slos = parse_slos(a.goodput)
    prompts = make_prompts(a.num_prompts, a.input_len, a.vocab_size, a.seed)
    serve_overrides = {**overrides, **({"serve.port": a.port} if a.port else {}),
                       **parse_sets(a.set),
                       **({"serve.stream_interval": a.stream_interval} if a.stream_interval else {})}
    url = a.url or serve_in_process(a.config, serve_overrides, a.direct_ingress)
    try:
        runs = _runs(a, url, prompts, slos)
    finally:
        if a.config:
            stop_in_process()
    offline = None
    if a.offline:
        offline = run_offline(a.config, overrides, prompts, a.output_len, a.offline_threads)
        best = max(r["output_throughput"] for r in runs)
        offline["serving_over_offline_at_saturation"] = best / offline["output_throughput"]
        print(f"offline LLM.generate: {offline['request_throughput']:.2f} req/s, "
              f"{offline['output_throughput']:.0f} out tok/s; serving/offline at saturation "
              f"{offline['serving_over_offline_at_saturation']:.1%}")
    meta = run_meta(slos_ms=slos, num_prompts=a.num_prompts, input_len=a.input_len, output_len=a.output_len)
    with open(a.out_json, "w") as f:
        json.dump({"meta": meta, "runs": runs, "offline": offline}, f, indent=2)
    plot(runs, offline, a.out_png, f"serving, {a.input_len} in / {a.output_len} out tokens, "
                                   f"{a.num_prompts} prompts")
    print(f"wrote {a.out_json} and {a.out_png}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _runs(a: argparse.Namespace, url: str, prompts: list[list[int]],
          slos: dict[str, float]) -> list[dict[str, Any]]:
    """A warm-up of 8 short requests, then one run per --rates entry."""
    model = model_name(url, a.api_key)
    run(run_load(url, bodies_for(prompts[:8], 8, model), math.inf, None, 60, a.api_key, 0))
    runs = []
    for rate in (float(r) for r in a.rates.split(",")):
        results, wall = run(run_load(url, bodies_for(prompts, a.output_len, model), rate,
                                     a.max_concurrency, a.duration_s, a.api_key, a.seed))
        label = "inf" if math.isinf(rate) else f"{rate:g}"
        s = {"label": label, "rate": rate, **summarize(results, wall, slos)}
        _print_run(s["label"], s)
        runs.append(s)
    return runs


if __name__ == "__main__":
    sys.exit(main())
