#!/usr/bin/env python3
"""KV tiers below the paged pool (docs/kv_tiers.md) on a multi-turn workload
whose sessions outgrow the pool.

Workload (the Doc-QA shape, scaled to a CPU box): --sessions sessions, each
a random document of --doc tokens, then --turns turns; turn t's prompt is
the previous prompt + its --output tokens + --question new tokens. Turns go
round robin over the sessions, one request at a time (one user each), so a
pool of --pool-blocks blocks holds about two sessions and the rest are
evicted before their next turn. Greedy, fp32, ignore_eos; the random-weight
30M Llama of bench/lib/models.py.

Reported per mode (tier off; host tier on):
  - prompt tokens computed, against an ideal infinite prefix cache (every
    full block of a session's earlier turns reused);
  - TTFT p50/p90 (arrival to first token, per request) and output tokens/s;
  - with 0% hits (every prompt unique, same lengths, the same evictions):
    throughput off vs on, the overhead of saving evicted blocks (--repeats
    interleaved runs, medians: this shared 2-core box is noisy);
  - the disk tier after a restart: a new engine on the same folder serves a
    --restart-prefix-token session (8K by default, on the same shape with
    8448 positions) from disk; share of the prompt from disk and TTFT
    against recomputing it.
Every mode's tokens are compared with the tier-off run (they must be equal).

Usage:
  .venv/bin/python bench/kv_tiers.py --json bench/out/kv_tiers.json
  .venv/bin/python bench/kv_tiers.py --quick
  .venv/bin/python bench/kv_tiers.py --only-restart
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.meta import emit_report, run_meta  # noqa: E402
from bench.lib.models import model_dir  # noqa: E402
from bench.lib.stats import percentile  # noqa: E402
from bench.lib.ttft import TTFT, record_ttft  # noqa: E402
from conveyor import LLM, SamplingParams  # noqa: E402


@dataclass
class Result:
    tokens: list[list[int]] = field(default_factory=list)
    prompt_tokens: int = 0
    computed: int = 0  # prompt tokens not served from any cache
    ideal_computed: int = 0
    ttft: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    output_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "computed": self.computed,
                "ideal_computed": self.ideal_computed,
                "computed_vs_ideal": round(self.computed / max(self.ideal_computed, 1), 3),
                "ttft_p50_ms": round(1e3 * percentile(self.ttft, 50), 1),
                "ttft_p90_ms": round(1e3 * percentile(self.ttft, 90), 1),
                "output_tok_s": round(self.output_tokens / self.wall_s, 1),
                "wall_s": round(self.wall_s, 2),
                "kv": {k: v for k, v in self.metrics.items() if k.startswith("conveyor_kv")}}


def run_sessions(path: str, a: argparse.Namespace, unique: bool, **tier: Any) -> Result:
    rng = random.Random(0)
    sessions = [[rng.randrange(4, 8000) for _ in range(a.doc)] for _ in range(a.sessions)]
    seen = [0] * a.sessions  # tokens of the session an infinite cache holds (its KV was computed)
    llm = LLM(model=path, num_gpu_blocks=a.pool_blocks, block_size=16, max_model_len=a.max_len,
              max_num_seqs=8, **tier)
    sp = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True)
    res = Result()
    llm.generate([[5] * 32], sp, use_tqdm=False)  # warm-up
    del TTFT[:]
    t0 = time.perf_counter()
    for _turn in range(a.turns):
        for s in range(a.sessions):
            prompt = sessions[s]
            if unique:  # same length, nothing shared with anything before
                prompt = [rng.randrange(4, 8000) for _ in prompt]
            o = llm.generate([prompt], sp, use_tqdm=False)[0]
            out = list(o.outputs[0].token_ids)
            res.tokens.append(out)
            res.prompt_tokens += len(prompt)
            res.computed += len(prompt) - o.num_cached_tokens
            ideal_hit = 0 if unique else min(seen[s], len(prompt) - 1) // 16 * 16
            res.ideal_computed += len(prompt) - ideal_hit
            res.output_tokens += len(out)
            seen[s] = len(prompt) + len(out) - 1  # the last sampled token's KV is not computed
            sessions[s] = prompt + out + [rng.randrange(4, 8000) for _ in range(a.question)]
    res.wall_s = time.perf_counter() - t0
    res.ttft = list(TTFT)
    res.metrics = llm.get_metrics()
    llm.shutdown()
    return res


def zero_hits(path: str, a: argparse.Namespace) -> dict[str, Any]:
    """Every prompt unique: the tier only saves. Off and on interleaved
    --repeats times (a shared box is noisy); medians of output tokens/s."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    same = True
    for _ in range(a.repeats):
        off = run_sessions(path, a, unique=True)
        on = run_sessions(path, a, unique=True, offload_cpu_gb=a.cpu_gb)
        same = same and on.tokens == off.tokens
        rates["off"].append(round(off.output_tokens / off.wall_s, 1))
        rates["on"].append(round(on.output_tokens / on.wall_s, 1))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"off_tok_s": rates["off"], "on_tok_s": rates["on"],
            "overhead_of_medians": round(1 - med["on"] / med["off"], 4), "same_tokens": same}


def disk_restart(path: str, a: argparse.Namespace, folder: str) -> dict[str, Any]:
    """One long session prefix written by engine 1; engine 2 (same folder) serves it from disk."""
    rng = random.Random(1)
    doc = [rng.randrange(4, 8000) for _ in range(a.restart_prefix)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    disk = dict(offload_disk_path=folder, offload_disk_gb=2.0)
    out: dict[str, Any] = {"prefix_tokens": len(doc)}
    max_len = a.restart_prefix + 64
    llm = LLM(model=path, block_size=16, max_model_len=max_len, **disk)
    first = llm.generate([doc], sp, use_tqdm=False)[0]
    llm.shutdown()
    follow = doc + list(first.outputs[0].token_ids) + [7] * 16
    for name, kw in (("recompute", {}), ("from_disk", disk)):
        llm = LLM(model=path, block_size=16, max_model_len=max_len, **kw)
        llm.generate([[5] * 32], sp, use_tqdm=False)
        del TTFT[:]
        o = llm.generate([follow], sp, use_tqdm=False)[0]
        out[name] = {"ttft_ms": round(1e3 * TTFT[0], 1), "cached_tokens": o.num_cached_tokens,
                     "tokens": list(o.outputs[0].token_ids)}
        llm.shutdown()
    out["share_from_disk"] = round(out["from_disk"]["cached_tokens"] / len(follow), 3)
    out["same_tokens"] = out["from_disk"].pop("tokens") == out["recompute"].pop("tokens")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--doc", type=int, default=384)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=80)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--cpu-gb", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=3, help="0%%-hit runs, off and on interleaved")
    p.add_argument("--quick", action="store_true", help="4 sessions, 3 turns, 256-token documents")
    p.add_argument("--restart-prefix", type=int, default=8192,
                   help="the disk-restart session's prefix, in tokens (<= 8384)")
    p.add_argument("--only-restart", action="store_true", help="the disk-restart measure alone")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.sessions, a.turns, a.doc, a.pool_blocks, a.repeats = 4, 3, 256, 40, 1
    a.max_len = min(a.max_len, (a.pool_blocks - 1) * 16)  # one request must fit the pool
    if not 16 <= a.restart_prefix <= 8384:
        p.error("--restart-prefix must be in [16, 8384] (the model has 8448 positions)")
    record_ttft()
    report: dict[str, Any] = {"meta": run_meta(args=vars(a))}
    if not a.only_restart:
        path = model_dir("30m")
        off = run_sessions(path, a, unique=False)
        on = run_sessions(path, a, unique=False, offload_cpu_gb=a.cpu_gb)
        report["multi_turn"] = {"off": off.summary(), "cpu_tier": on.summary(),
                                "same_tokens": on.tokens == off.tokens}
        report["zero_hits"] = zero_hits(path, a)
    folder = tempfile.mkdtemp(prefix="conveyor-kv-bench-")
    try:
        report["disk_restart"] = disk_restart(model_dir("30m8k"), a, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    emit_report(report, a.json)


if __name__ == "__main__":
    main()
