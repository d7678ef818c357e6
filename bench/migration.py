#!/usr/bin/env python3
"""Live migration (issue 26): drain one of 2 engines with --streams streams in
flight and measure what the streams see.

Offline AsyncLLM, data_parallel_size=2 (in-process engines, each with its own
worker process), the offline bench's 30M Llama shape (vocab 512). Half the
streams greedy, half seeded at temperature 0.8, random-token prompts, every
stream --max-tokens long (ignore_eos).

1. Undisturbed run: each stream's tokens (the reference) and TPOT (median gap
   between its deliveries).
2. Drain run: once every stream has delivered --warm tokens, drain engine 0.
   Reports the handover time (drain() call until it returns: every moved
   request aborted on engine 0, resubmitted, and engine 0 empty), the streams
   moved, the tokens engine 1 prefilled again (conveyor:migration_reprefill_tokens),
   each moved stream's largest gap between tokens against its own TPOT, and
   one engine's start time (what a rebuild costs at least) for comparison.
   Passes when every stream's tokens equal the reference.
3. The goal's bound: 2 x TPOT + the prefill time of the longest moved context
   (prompt + tokens it had when it moved), that prefill timed alone on an idle engine
   (a fresh prompt of that length, one token). Also the largest gap of the
   streams that stayed (engine 1's own, which share its steps with the moved
   contexts' prefill).

--no-paced: parallel.paced_drain off (every request moves at once); by
default the paced move (waves of at most the longest moved context).
--move-kv: the engines share a KV folder (the disk tier's path), so a moved
request loads the blocks its old engine left there instead of re-prefilling.

  .venv/bin/python bench/migration.py                 # 64 streams
  .venv/bin/python bench/migration.py --streams 16 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import model_dir  # noqa: E402
from bench.lib.prompts import mixed_params, random_prompts  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402


async def _stream(llm: Any, i: int, prompt: list[int], sp: Any, times: list[float], toks: list[int],
                  warm: asyncio.Event | None, warm_n: int) -> None:
    """One stream: its tokens and their arrival times; ``warm`` set once it has warm_n tokens."""
    async for ro in llm.generate(prompt, sp, request_id=f"s{i}"):
        now = time.monotonic()
        for d in ro.outputs:
            toks += d.token_ids
            if d.token_ids:
                times.append(now)
        if warm is not None and len(toks) >= warm_n:
            warm.set()
            warm = None


async def _run(llm: Any, prompts: list[list[int]], params: list[Any], warm_n: int, drain: bool) -> dict:
    """Every stream at once; with drain, engine 0 drained once each has warm_n tokens."""
    n = len(prompts)
    times: list[list[float]] = [[] for _ in range(n)]
    toks: list[list[int]] = [[] for _ in range(n)]
    warms = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(_stream(llm, i, p, sp, times[i], toks[i], warms[i], warm_n))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    out: dict = {}
    if drain:
        await asyncio.gather(*(w.wait() for w in warms))
        owners = dict(llm.client._live)  # request id -> engine, just before the drain
        t0 = time.monotonic()
        out["moved"] = await llm.drain(0, timeout_s=300)
        out["handover_s"] = time.monotonic() - t0
        out["drain_end"] = time.monotonic()
        out["drain_at"] = t0
        # Engine request ids are "<stream id>-<child>-<suffix>".
        out["moved_idx"] = sorted({int(rid.split("-")[0][1:]) for rid, e in owners.items() if e == 0})
    await asyncio.gather(*tasks)
    out["times"], out["toks"] = times, toks
    return out


async def _prefill_time(llm: Any, n: int, seed: int) -> float:
    """Time to the first token of a fresh n-token prompt on the idle engines (median of 3)."""
    from conveyor.engine import SamplingParams

    rng, times = random.Random(seed + 1), []
    for k in range(3):
        prompt = [rng.randrange(4, 512) for _ in range(n)]
        t0 = time.monotonic()
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"p{k}"):
            pass
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def _gaps(ts: list[float]) -> list[float]:
    return [b - a for a, b in zip(ts, ts[1:])]


async def main_async(a: argparse.Namespace) -> dict:
    """The undisturbed run, the drain run, the bound's prefill; the result."""
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    path = model_dir("30m_v512", os.path.join(a.model_dir, "llama30m_v512"))
    kv = dict(offload_disk_path=tempfile.mkdtemp(prefix="conveyor-move-kv-"), offload_disk_gb=1.0) if a.move_kv else {}
    cfg = build_config(model=path, max_model_len=1024, data_parallel_size=2, max_num_seqs=a.streams,
                       num_gpu_blocks=a.streams * 24, **{"parallel.paced_drain": a.paced}, **kv)
    t0 = time.monotonic()
    llm = AsyncLLM(cfg)
    start_s = (time.monotonic() - t0) / 2
    prompts = random_prompts(a.streams, 64, 192, a.seed, vocab=512)
    params = mixed_params(a.streams, a.max_tokens)
    try:
        ref = await _run(llm, prompts, params, a.warm, drain=False)
        got = await _run(llm, prompts, params, a.warm, drain=True)
        from conveyor.engine.core_client import metric_dict

        m = metric_dict(llm.client.metric_rows())
        # Contexts grow while a paced drain's later waves wait: the longest as sent.
        longest = llm.client.migrations.longest_context
        prefill_s = await _prefill_time(llm, longest, a.seed)
    finally:
        await llm.shutdown()
    tpot = [statistics.median(_gaps(t)) for t in ref["times"]]
    moved_idx = got["moved_idx"]
    ratios = sorted(max(_gaps(got["times"][i])) / tpot[i] for i in moved_idx)
    gaps = sorted(max(_gaps(got["times"][i])) for i in moved_idx)
    max_gap = gaps[-1]
    stayed = [i for i in range(a.streams) if i not in set(moved_idx)]
    t0, t1 = got["drain_at"], got["drain_end"]
    stayed_gap = max((b - x for i in stayed for x, b in zip(got["times"][i], got["times"][i][1:])
                      if b >= t0 and x <= t1), default=0.0)
    tpot_med = statistics.median(tpot)
    bound = 2 * tpot_med + prefill_s
    return {
        "streams": a.streams, "max_tokens": a.max_tokens, "moved_streams": got["moved"],
        "identical": got["toks"] == ref["toks"],
        "handover_s": round(got["handover_s"], 3), "engine_start_s": round(start_s, 2),
        "reprefill_tokens": m['conveyor:migration_reprefill_tokens_total{engine="1"}'],
        "tpot_ms_median": round(statistics.median(tpot) * 1e3, 1),
        "largest_gap_ms": round(max_gap * 1e3, 1),
        "moved_streams_largest_gap_ms": {"p50": round(percentile(gaps, 50) * 1e3, 1),
                                         "p90": round(percentile(gaps, 90) * 1e3, 1)},
        "moved_streams_within_bound": sum(g <= bound for g in gaps),
        "largest_gap_over_tpot": {"p50": round(percentile(ratios, 50), 1), "max": round(ratios[-1], 1)}
        if ratios else None,
        "longest_moved_context": longest, "its_prefill_ms": round(prefill_s * 1e3, 1),
        "goal_bound_ms": round(bound * 1e3, 1),
        "goal_met": max_gap <= bound,
        "stayed_streams_largest_gap_during_drain_ms": round(stayed_gap * 1e3, 1),
        "paced_drain": a.paced, "move_kv": a.move_kv,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    """Run it; exit 1 unless every stream's tokens equal the undisturbed run's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warm", type=int, default=8, help="tokens every stream has before the drain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paced", action=argparse.BooleanOptionalAction, default=True,
                   help="parallel.paced_drain: move in waves (default); off: all at once")
    p.add_argument("--move-kv", action="store_true", help="share a KV folder: moves carry their KV")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "conveyor-bench-models"))
    a = p.parse_args()
    res = asyncio.run(main_async(a))
    print(json.dumps(res, indent=2))
    if not res["identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
