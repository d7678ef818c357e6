"""How much host time per step async scheduling hides.

The worker records when each step's forward starts (execute_model) and when
its sampling ends (sample_tokens); the idle time is the gap between one step's
end and the next step's start, which the core spends on update_from_output,
schedule() and sending the step. With async scheduling the next step is
already queued when one ends, so the gap is only the hand-over.

    python bench/async_scheduling.py [--batch 32] [--tokens 64] [--device cpu]

Runs a tiny random Llama (bench/lib/models.py, "tiny") with executor uniproc,
async off and on, interleaved --rounds times; prints the per-step gap (median,
mean), the step time and the decode throughput, and whether tokens agree.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import model_dir  # noqa: E402
from bench.lib.prompts import random_prompts  # noqa: E402
from conveyor.engine import LLM, SamplingParams  # noqa: E402


class StepClock:
    """Wraps the in-process worker's execute_model / sample_tokens."""

    def __init__(self, worker: Any) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        ex, sa = worker.execute_model, worker.sample_tokens

        def execute_model(*a: Any, **k: Any) -> Any:
            self.starts.append(time.perf_counter())
            return ex(*a, **k)

        def sample_tokens(*a: Any, **k: Any) -> Any:
            out = sa(*a, **k)
            self.ends.append(time.perf_counter())
            return out
        worker.execute_model, worker.sample_tokens = execute_model, sample_tokens

    def gaps_ms(self) -> list[float]:
        """Idle time before each step that follows a sampled one (ms)."""
        return [(s - e) * 1e3 for e, s in zip(self.ends, self.starts[1:]) if s >= e]


def run_once(model: str, prompts: list[list[int]], sp: SamplingParams, async_: str, device_kw: dict) -> dict:
    """One engine with async scheduling ``async_``: per-step gaps, step times, tok/s, tokens."""
    llm = LLM(model=model, async_scheduling=async_, **device_kw)
    try:
        llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
        clock = StepClock(llm.engine.executor.worker)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    gaps = clock.gaps_ms()
    steps = [(e - s) * 1e3 for s, e in zip(clock.starts, clock.ends)]
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(async_=async_, gap_med=statistics.median(gaps), gap_mean=statistics.fmean(gaps),
                step_med=statistics.median(steps), tok_s=n_tok / wall, wall=wall,
                tokens=[o.outputs[0].token_ids for o in outs])


def main(argv: list[str] | None = None) -> int:
    """Async scheduling off and on, interleaved --rounds times; the gap table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random Llama)")
    args = ap.parse_args(argv)
    model = args.model or model_dir("tiny")
    prompts = random_prompts(args.batch, args.prompt_len, args.prompt_len, seed=3)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=max(args.batch, 2))
    rows = []
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            rows.append(run_once(model, prompts, sp, mode, kw))
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"batch {args.batch}, {args.tokens} tokens each, prompt {args.prompt_len}; same tokens: {same}")
    print("| async | idle gap median (ms) | idle gap mean (ms) | step median (ms) | tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for mode in ("off", "on"):
        rs = [r for r in rows if r["async_"] == mode]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        print(f"| {mode} | {med('gap_med'):.3f} | {med('gap_mean'):.3f} | {med('step_med'):.2f} | "
              f"{med('tok_s'):.0f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
