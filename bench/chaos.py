#!/usr/bin/env python3
"""Chaos run (issue 13): load at about half saturation against our own Serve
app on the tiny model (executor "ray", TP=2), SIGKILLing a random worker rank
every --kill-every seconds. Passes when no request fails and every output
equals an undisturbed run's; reports recovery times and plots throughput
over time with the kills marked.

1. Reference + calibration: --unique distinct request bodies (random
   token-id prompts; even ones greedy, odd ones seeded at temperature 0.8),
   all at once, undisturbed. Their outputs are the reference; their output
   tokens/s is saturation.
2. Chaos: Poisson arrivals at half the saturated request rate for --duration
   seconds, request i reusing body i % --unique (so each output has a
   reference), a random RayWorkerActor SIGKILLed every --kill-every seconds.
   Recovery time of a kill = from the kill to the end of the longest pause in
   token arrivals after it (what users see: detection, rebuild, recompute);
   the engine's own rebuild time comes from /metrics
   (conveyor:engine_recovery_seconds, sum / count).

  .venv/bin/python bench/chaos.py                      # 3 minutes, a kill every 30 s
  .venv/bin/python bench/chaos.py --duration 60 --kill-every 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)
OUT = os.path.join(REPO, "bench", "out")


@dataclass
class Stream:
    body: int  # index of its body
    start: float = 0.0
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    done: bool = False
    error: str = ""
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)

    @property
    def ok(self) -> bool:
        return self.done and not self.error and self.finish == "length"


def make_bodies(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(input_len)]
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 7000 + i}
        bodies.append({"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "logprobs": 0,
                       "stream": True, **sampling})
    return bodies


async def one(client: Any, body: dict[str, Any], s: Stream) -> Stream:
    s.start = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    s.done = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    s.error = str(ev["error"].get("message"))
                    continue
                ch = ev["choices"][0]
                n = len(ch["logprobs"]["tokens"])
                s.text += ch["text"]
                s.tokens += n
                s.finish = ch["finish_reason"] or s.finish
                s.arrivals.append((time.monotonic(), n))
    except Exception as e:  # noqa: BLE001 - a failed request, counted
        s.error = f"{type(e).__name__}: {e}"
    return s


def worker_pids() -> list[int]:
    """RayWorkerActor processes of the Ray instance this process started."""
    parent, workers = {}, []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RayWorkerActor"):
                    workers.append(int(p))
        except (OSError, ValueError, IndexError):
            continue

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent.get(pid, 0)
        return False
    return sorted(p for p in workers if ours(p))


async def reference_run(url: str, bodies: list[dict[str, Any]]) -> tuple[list[Stream], float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(bodies))) as c:
        t0 = time.monotonic()
        out = await asyncio.gather(*(one(c, b, Stream(i)) for i, b in enumerate(bodies)))
        return list(out), time.monotonic() - t0


async def chaos_run(url: str, bodies: list[dict[str, Any]], rate: float, a: argparse.Namespace
                    ) -> tuple[list[Stream], list[tuple[float, int]], float]:
    """Streams, kills [(time, pid)], t0."""
    import httpx

    rng = random.Random(a.seed)
    kills: list[tuple[float, int]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=512)) as c:
        t0 = time.monotonic()

        async def killer() -> None:
            k = 1
            while t0 + k * a.kill_every < t0 + a.duration:
                await asyncio.sleep(t0 + k * a.kill_every - time.monotonic())
                pids = worker_pids()
                if pids:
                    pid = rng.choice(pids)
                    os.kill(pid, signal.SIGKILL)
                    kills.append((time.monotonic(), pid))
                    print(f"t={time.monotonic() - t0:6.1f}s killed worker pid {pid}", flush=True)
                k += 1

        kill_task = asyncio.create_task(killer())
        tasks, i = [], 0
        while time.monotonic() - t0 < a.duration:
            tasks.append(asyncio.create_task(one(c, bodies[i % len(bodies)], Stream(i % len(bodies)))))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await kill_task
        streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    return list(streams), kills, t0


def recovery_times(streams: list[Stream], kills: list[tuple[float, int]], window_s: float = 60.0
                   ) -> list[float]:
    """Per kill: seconds from the kill to the end of the longest pause in
    token arrivals (any stream) after it, within window_s and before the next
    kill: the rebuild's stall as users see it. (The first token after a kill
    is no measure: the outputs of steps finished before the death still arrive.)"""
    arrivals = sorted(t for s in streams for t, _ in s.arrivals)
    out = []
    for j, (t_kill, _) in enumerate(kills):
        until = min(t_kill + window_s, kills[j + 1][0] if j + 1 < len(kills) else float("inf"))
        after = [t_kill] + [t for t in arrivals if t_kill < t <= until]
        if len(after) < 2:
            out.append(float("inf"))
            continue
        end = max(range(1, len(after)), key=lambda j: after[j] - after[j - 1])
        out.append(after[end] - t_kill)
    return out


def throughput_series(streams: list[Stream], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    bins: dict[int, int] = {}
    for s in streams:
        for t, n in s.arrivals:
            bins[int((t - t0) // bin_s)] = bins.get(int((t - t0) // bin_s), 0) + n
    last = max(bins) if bins else 0
    return [k * bin_s for k in range(last + 1)], [bins.get(k, 0) / bin_s for k in range(last + 1)]


def plot(streams: list[Stream], kills: list[tuple[float, int]], t0: float, saturated: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = throughput_series(streams, t0)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ys, lw=1, label="output tokens/s (1 s bins)")
    ax.axhline(saturated, color="gray", ls=":", label=f"saturated ({saturated:.0f} tok/s)")
    for j, (t, _) in enumerate(kills):
        ax.axvline(t - t0, color="red", ls="--", lw=1, label="worker SIGKILL" if j == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens/s")
    ax.set_title("chaos: tiny model, Serve + executor ray TP=2, a random worker killed every 30 s")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def engine_recovery_mean(url: str) -> tuple[float, float]:
    """(restarts, mean rebuild seconds) from /metrics."""
    import httpx

    vals: dict[str, float] = {}
    for ln in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in ("conveyor:engine_restarts_total", "conveyor:engine_recovery_seconds_sum",
                     "conveyor:engine_recovery_seconds_count"):
            if ln.startswith(name + "{"):
                vals[name] = float(ln.rsplit(" ", 1)[1])
    n = vals.get("conveyor:engine_recovery_seconds_count", 0.0)
    return vals.get("conveyor:engine_restarts_total", 0.0), (
        vals.get("conveyor:engine_recovery_seconds_sum", 0.0) / n if n else 0.0)


def write_config(model: str, a: argparse.Namespace) -> str:
    cfg = {"model": {"path": model, "max_model_len": 1024},
           "parallel": {"executor": "ray", "tensor_parallel_size": a.tp,
                        # a kill every 30 s: more restarts than the default budget (3 per 600 s)
                        "max_restarts": 100, "restart_window_s": 600.0},
           "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
           "cache": {"num_gpu_blocks": 1024},
           "serve": {"host": "127.0.0.1", "port": a.port, "served_model_name": "tiny",
                     "metrics_public": True}}
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="chaos-")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(OUT, "demo_model"), help="built if missing")
    p.add_argument("--duration", type=float, default=180.0)
    p.add_argument("--kill-every", type=float, default=30.0)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--unique", type=int, default=64, help="distinct request bodies")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--load", type=float, default=0.5, help="fraction of the saturated request rate")
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=os.path.join(OUT, "chaos.json"))
    p.add_argument("--out-png", default=os.path.join(OUT, "chaos.png"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out_json)), exist_ok=True)
    from serve_load import start_server, stop_server

    from conveyor.cluster.demo.model import ensure_demo_model

    ensure_demo_model(a.model)
    bodies = make_bodies(a.unique, a.input_len, a.output_len, 512, a.seed)
    url = start_server(write_config(os.path.abspath(a.model), a), {})
    try:
        asyncio.run(reference_run(url, bodies[:4]))  # warm-up
        ref, ref_wall = asyncio.run(reference_run(url, bodies))
        if not all(s.ok for s in ref):
            raise SystemExit(f"the undisturbed run failed: {[s.error for s in ref if not s.ok][:3]}")
        saturated_rps = len(ref) / ref_wall
        saturated_tps = sum(s.tokens for s in ref) / ref_wall
        rate = a.load * saturated_rps
        print(f"saturated: {saturated_rps:.2f} req/s, {saturated_tps:.0f} tok/s; chaos at {rate:.2f} req/s",
              flush=True)
        streams, kills, t0 = asyncio.run(chaos_run(url, bodies, rate, a))
        restarts, engine_mean = engine_recovery_mean(url)
    finally:
        stop_server()
    failed = [s for s in streams if not s.ok]
    mismatched = [s for s in streams if s.ok and (s.text, s.tokens) != (ref[s.body].text, ref[s.body].tokens)]
    rec = recovery_times(streams, kills)
    wall = max((t for s in streams for t, _ in s.arrivals), default=t0) - t0
    summary = {
        "requests": len(streams), "failed": len(failed), "mismatched": len(mismatched),
        "kills": len(kills), "engine_restarts": restarts,
        "recovery_s_p50": statistics.median(rec) if rec else None, "recovery_s_max": max(rec) if rec else None,
        "recovery_s": rec, "engine_rebuild_s_mean": engine_mean,
        "saturated_req_s": saturated_rps, "saturated_tok_s": saturated_tps, "load_req_s": rate,
        "chaos_tok_s": sum(s.tokens for s in streams) / wall if wall > 0 else 0.0,
        "failures": [s.error or f"finish {s.finish}, done {s.done}" for s in failed[:5]],
        "kill_s": [t - t0 for t, _ in kills],
        "tok_s_per_second": throughput_series(streams, t0)[1],
    }
    meta = {"argv": sys.argv, "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(a.out_json, "w") as f:
        json.dump({"meta": meta, "summary": summary}, f, indent=2)
    plot(streams, kills, t0, saturated_tps, a.out_png)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("recovery_s", "tok_s_per_second")},
                     indent=2))
    print(f"recovery per kill (s): {', '.join(f'{x:.1f}' for x in rec)}")
    print(f"wrote {a.out_json} and {a.out_png}")
    return 0 if not failed and not mismatched and len(kills) == restarts else 1


if __name__ == "__main__":
    sys.exit(main())
