"""Decode step time against the bandwidth floor (tests/gpu/run.sh).

A random ~1B Llama (hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
MLP 8192, vocab 32000; bf16) decodes at batch 1, 64 and 256 with a context of
--ctx tokens. A decode step must read every weight once and each request's KV
once, so its floor is

    (weight bytes + KV bytes read per step) / copy bandwidth

where the copy bandwidth is measured in the same run (a device-to-device copy
of --copy-gib, counting bytes read and written). The step time is the median
interval between consecutive decode-only steps (every request scheduled with
one token), read from the engine loop.

    python bench/decode_floor.py [--batches 1,64,256] [--ctx 1024] [--out 64]
    python bench/decode_floor.py --tiny --batches 1,4    # CPU dry run of the code path
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import model_dir  # noqa: E402
from bench.lib.prompts import random_prompts  # noqa: E402
from conveyor.engine import LLM, SamplingParams  # noqa: E402


def copy_bandwidth(device: str, gib: float) -> float:
    """Bytes read + written per second by a device-to-device copy (median of 10)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times[3:])


def decode_step_times(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[float]:
    """Intervals between consecutive decode-only steps (every request, one token)."""
    core, orig, stamps = llm.engine, llm.engine.step_fn, []
    sched = core.scheduler
    batch = len(prompts)

    def step() -> Any:
        out = orig()
        running = sched.running
        decoding = len(running) == batch and all(r.num_output_tokens > 0 for r in running)
        stamps.append((time.perf_counter(), decoding and out[0] is not None))
        return out
    core.step_fn = step
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        core.step_fn = orig
    return [b[0] - a[0] for a, b in zip(stamps, stamps[1:]) if a[1] and b[1]]


def main(argv: list[str] | None = None) -> int:
    """Median decode step at each batch against its bandwidth floor (the table)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry run)")
    ap.add_argument("--async-scheduling", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    # Random bf16 weights, filled on the device (fast), and the demo tokenizer
    # (bench/lib/models.py's floor-1b / floor-tiny; built once, then reused).
    path = model_dir("floor-tiny" if args.tiny else "floor-1b", device=device)
    bw = copy_bandwidth(device, 0.25 if args.tiny else args.copy_gib)
    llm = LLM(model=path, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=args.ctx + args.out + 8,
              max_num_batched_tokens=max(8192, max(batches)), async_scheduling=args.async_scheduling,
              enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    try:
        weight_bytes = sum(p.numel() * p.element_size()
                           for p in llm.engine.executor.worker.model_runner.model.parameters())
        kv_per_token = llm.engine.kv_info.bytes_per_block // llm.engine.kv_info.block_size
        print(f"device {device}; weights {weight_bytes / 1e9:.3f} GB; KV {kv_per_token} B/token; "
              f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); async "
              f"{llm.engine.async_scheduling}; graphs "
              f"{llm.engine.executor.worker.model_runner.graphs is not None}")
        print("| batch | ctx | step median (ms) | floor (ms) | floor / step | weight GB | KV GB / step |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for b in batches:
            prompts = random_prompts(b, args.ctx, args.ctx, seed=b, vocab=500)
            sp = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
            steps = decode_step_times(llm, prompts, sp)
            kv = b * (args.ctx + args.out / 2) * kv_per_token
            floor = (weight_bytes + kv) / bw
            med = statistics.median(steps) if steps else float("nan")
            print(f"| {b} | {args.ctx} | {med * 1e3:.3f} | {floor * 1e3:.3f} | {floor / med:.0%} | "
                  f"{weight_bytes / 1e9:.2f} | {kv / 1e9:.2f} |", flush=True)
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
