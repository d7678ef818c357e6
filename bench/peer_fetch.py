#!/usr/bin/env python3
"""Where a peer pull starts to beat a recompute (cache.peer_fetch_min_tokens).

Two engines behind the round-robin router share a KV folder (the disk tier's
path). For each prefix length N: a request of N random tokens runs on one
engine (its blocks land in the folder when it finishes); then the same N
tokens plus 16 new ones go to the other engine, which either recomputes the
prefix (peer_fetch off) or loads it from the folder (on, min tokens 1).
Reported per N: the second request's TTFT (median of --reps) both ways and
their ratio; the crossover is the smallest N from which the pull is faster.
Greedy; the tokens of both runs are compared. The random-weight 30M Llama
of bench/lib/models.py, fp32.

Usage:
  .venv/bin/python bench/peer_fetch.py --json bench/out/peer_fetch.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.meta import emit_report, run_meta  # noqa: E402
from bench.lib.models import model_dir  # noqa: E402
from bench.lib.ttft import TTFT, record_ttft  # noqa: E402
from conveyor import LLM, SamplingParams  # noqa: E402


def measure(path: str, peer: bool, lengths: list[int], reps: int) -> tuple[dict[int, float], list[list[int]]]:
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    ttft: dict[int, float] = {}
    tokens: list[list[int]] = []
    with LLM(model=path, max_model_len=2048, data_parallel_size=2, router="round_robin",
             offload_disk_path=tempfile.mkdtemp(prefix="conveyor-peer-"), offload_disk_gb=1.0,
             peer_fetch=peer, peer_fetch_min_tokens=1) as llm:
        llm.generate([[5] * 40, [6] * 40], sp, use_tqdm=False)  # both engines warm
        for n in lengths:
            seen = []
            for _ in range(reps):
                prefix = [rng.randrange(4, 8000) for _ in range(n)]
                llm.generate([prefix], sp, use_tqdm=False)  # one engine; the next request: the other
                del TTFT[:]
                o = llm.generate([prefix + [rng.randrange(4, 8000) for _ in range(16)]], sp, use_tqdm=False)[0]
                seen.append(TTFT[0])
                tokens.append(list(o.outputs[0].token_ids))
            ttft[n] = statistics.median(seen)
    return ttft, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16,32,64,128,256,512,1024,1536")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    record_ttft()
    path = model_dir("30m")
    off, tok_off = measure(path, False, lengths, a.reps)
    on, tok_on = measure(path, True, lengths, a.reps)
    rows = [{"prefix_tokens": n, "recompute_ms": round(1e3 * off[n], 2), "pull_ms": round(1e3 * on[n], 2),
             "pull_vs_recompute": round(on[n] / off[n], 3)} for n in lengths]
    crossover = next((r["prefix_tokens"] for r in rows if r["pull_vs_recompute"] < 1.0), None)
    report = {"meta": run_meta(args=vars(a)), "rows": rows, "crossover_tokens": crossover,
              "same_tokens": tok_on == tok_off}
    emit_report(report, a.json)


if __name__ == "__main__":
    main()
