#!/usr/bin/env python3
"""Prefill/decode disaggregation against colocated engines, at the same engine
count (docs/disaggregation.md).

Offline AsyncLLM, --engines in-process engines (each with its own worker
process), the random-weight 30M Llama of bench/lib/models.py, fp32, greedy,
ignore_eos. Requests arrive as a seeded Poisson process at --rate per second.
Two workloads:
  long: --long-prompt-token prompts, --long-output tokens out (prefill-heavy);
  chat: --chat-prompt-token prompts, --chat-output tokens out.
For each P:D split of --splits ("0" = colocated: every engine does both; "1"
= one prefill engine and the rest decode; ...): TTFT p50/p99, inter-token
latency p50/p99, output tokens/s over the run, bytes moved per output token
(KV written and read through the shared folder), and whether every request's
tokens equal the colocated run's.

Usage:
  .venv/bin/python bench/disagg.py --json bench/out/disagg.json
  conveyor bench disagg --engines 3 --splits 0,1,2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.meta import emit_report, run_meta  # noqa: E402
from bench.lib.models import model_dir  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402


async def _one(llm: Any, rid: str, prompt: list[int], sp: Any, delay: float) -> dict[str, Any]:
    await asyncio.sleep(delay)
    t0 = time.monotonic()
    times: list[float] = []
    toks: list[int] = []
    async for ro in llm.generate(prompt, sp, request_id=rid):  # deltas: each output's new tokens
        for c in ro.outputs:
            times += [time.monotonic()] * len(c.token_ids)
            toks += c.token_ids
    return {"ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])], "tokens": toks,
            "end": times[-1]}


async def run(path: str, a: argparse.Namespace, prefill: int, prompts: list[list[int]],
              max_tokens: int) -> dict[str, Any]:
    from conveyor import SamplingParams
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    kv = dict(offload_disk_path=tempfile.mkdtemp(prefix="conveyor-pd-"), offload_disk_gb=2.0) if prefill else {}
    cfg = build_config(model=path, max_model_len=2048, data_parallel_size=a.engines, prefill_engines=prefill,
                       max_num_batched_tokens=a.budget, **kv)
    llm = AsyncLLM(cfg)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(a.seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(a.rate)
    try:
        await asyncio.gather(*[_one(llm, f"w{i}", [7, 8], SamplingParams(max_tokens=2), 0.0)
                               for i in range(a.engines)])  # every engine warm
        start = time.monotonic()
        res = await asyncio.gather(*[_one(llm, f"r{i}", p, sp, d) for i, (p, d) in enumerate(zip(prompts, delays))])
        wall = max(r["end"] for r in res) - start
        moved = llm.counters.kv_tiers.transfer_bytes
    finally:
        await llm.shutdown()
    ttft = sorted(r["ttft"] for r in res)
    itl = sorted(g for r in res for g in r["itl"])
    out_tokens = sum(len(r["tokens"]) for r in res)
    return {"prefill_engines": prefill, "decode_engines": a.engines - prefill if prefill else a.engines,
            "ttft_ms": {"p50": round(1e3 * percentile(ttft, 50), 1), "p99": round(1e3 * percentile(ttft, 99), 1)},
            "itl_ms": {"p50": round(1e3 * percentile(itl, 50), 2), "p99": round(1e3 * percentile(itl, 99), 2)},
            "output_tok_s": round(out_tokens / wall, 1), "wall_s": round(wall, 2),
            "bytes_moved_per_output_token": round(moved / out_tokens, 1),
            "tokens": [r["tokens"] for r in res]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--splits", default="0,1", help="prefill engines per run; 0 = colocated")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=3.0, help="arrivals per second (Poisson)")
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--chat-prompt", type=int, default=256)
    p.add_argument("--chat-output", type=int, default=96)
    p.add_argument("--budget", type=int, default=2048, help="scheduler.max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    splits = [int(x) for x in a.splits.split(",")]
    if any(not 0 <= s < a.engines for s in splits):
        p.error(f"every split must be in [0, {a.engines - 1}]")
    path = model_dir("30m")
    rng = random.Random(a.seed)
    work = {"long": ([[rng.randrange(4, 8000) for _ in range(a.long_prompt)] for _ in range(a.requests)],
                     a.long_output),
            "chat": ([[rng.randrange(4, 8000) for _ in range(a.chat_prompt)] for _ in range(a.requests)],
                     a.chat_output)}
    report: dict[str, Any] = {"meta": run_meta(args=vars(a))}
    for name, (prompts, out) in work.items():
        rows = [asyncio.run(run(path, a, s, prompts, out)) for s in splits]
        base = next((r["tokens"] for r in rows if r["prefill_engines"] == 0), rows[0]["tokens"])
        for r in rows:
            r["same_tokens_as_colocated"] = r.pop("tokens") == base
        report[name] = rows
    emit_report(report, a.json)


if __name__ == "__main__":
    main()
