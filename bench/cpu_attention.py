#!/usr/bin/env python3
"""CPU decode attention: the `cpu` backend's kernel against the `torch` backend.

The engine's case, not a cache-resident toy: one KV cache per layer (`--layers`,
each `--blocks` blocks, together far past L3), decode rows of `--batch`
requests whose blocks are scattered at random, every layer read in turn as a
forward does. Reports per layer the median time over `--rounds`, the K/V bytes
read per second, and a sequential read of a large tensor (`sum`) on the same
threads as the ceiling; the cpu backend once per kernel table this CPU runs
(`--isa`, default all of them: avx512, avx2, portable, then torch; a given list times only what
it names, `torch` included). Shapes default to the benches' 30M Llama (bench/lib/models.py) (8 query /
4 KV heads, head size 64, block 16), fp32 (`--dtype bfloat16`: cache and queries in bf16).
`--no-split` turns split-KV decode off, so one task runs each request (the kernel alone).
`--prefill CHUNK` times prefill instead: one request's CHUNK-token query chunk after each `--ctx`
value of cached prefix (the engine's chunked prefill: 2048-token chunks after 0, 2048, 4096,
6144 keys make an 8k prompt), one layer's cache, the own kernel per table (fp32; the portable
table and other dtypes run SDPA) against `torch` (ATen's flash SDPA), in GFLOP/s of causal attention.

Usage:
  .venv/bin/python bench/cpu_attention.py                 # one thread, ctx 96/160/256
  .venv/bin/python bench/cpu_attention.py --threads 2 --ctx 512 --isa avx2
  .venv/bin/python bench/cpu_attention.py --batch 1 --ctx 8192 --dtype bfloat16 --isa avx512,avx2
  .venv/bin/python bench/cpu_attention.py --threads 2 --prefill 2048 --ctx 0,2048,4096,6144
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from conveyor.kernels import cpu_attention, torch_attention  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", default="96,160,256", help="comma list of context lengths")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=2048, help="blocks per layer's cache")
    p.add_argument("--heads", default="8,4", help="query,kv heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--isa", default="",
                   help="comma list of kernel tables and/or torch (default: every one this CPU runs, then torch)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--no-split", action="store_true", help="no split-KV decode (part_len 0)")
    p.add_argument("--prefill", type=int, default=0, help="time a prefill chunk of this many tokens")
    return p.parse_args()


def _median_s(fn: Callable[[], None], rounds: int, calls: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _prefill(a: argparse.Namespace, names: list[str]) -> None:
    """One request's a.prefill-token chunk after each --ctx prefix, one layer."""
    hq, hkv = (int(x) for x in a.heads.split(","))
    d, bs, n, dt = a.head_size, a.block_size, a.prefill, getattr(torch, a.dtype)
    rng = np.random.default_rng(0)
    for prefix in (int(c) for c in a.ctx.split(",")):
        seq = prefix + n
        nblk = -(-seq // bs)
        cache = torch.randn(nblk + 1, 2, bs, hkv, d).to(dt)
        table = torch.from_numpy(rng.permutation(nblk + 1)[None, :nblk].astype(np.int32))
        query = torch.randn(n, hq, d).to(dt)
        qsl, lens = np.array([0, n], dtype=np.int64), np.array([seq], dtype=np.int64)
        flop = 4 * d * hq * (n * prefix + n * (n + 1) / 2)
        row = [f"prefix {prefix} + chunk {n}:"]
        for name in names:
            if name == "torch":
                def attend() -> object:
                    return torch_attention.paged_attention_torch(query, cache, table, qsl, lens, 0.125)
            else:
                cpu_attention.select_isa(name)

                def attend() -> object:
                    return cpu_attention.paged_attention_cpu(query, cache, table, qsl, lens, 0.125)
            s = _median_s(attend, a.rounds, 1)
            row.append(f"{name if name == 'torch' else 'cpu/' + name} {s * 1e3:.1f} ms {flop / s / 1e9:.0f} GFLOP/s")
        print("  ".join(row), flush=True)


def main() -> None:
    """Time the decode (or --prefill) attention of each kernel table and torch's."""
    a = _args()
    torch.set_num_threads(a.threads)
    if a.prefill:
        _prefill(a, a.isa.split(",") if a.isa else cpu_attention.supported_isas() + ["torch"])
        cpu_attention.select_isa("auto")
        return
    hq, hkv = (int(x) for x in a.heads.split(","))
    d, bs = a.head_size, a.block_size
    dt = getattr(torch, a.dtype)
    caches = [torch.randn(a.blocks, 2, bs, hkv, d).to(dt) for _ in range(a.layers)]
    big = torch.randn(100_000_000)
    seq_gbs = big.numel() * 4 / _median_s(lambda: big.sum(), 3, 1) / 1e9
    big = torch.empty(0)  # frees the 400 MB before the caches are read
    print(f"{a.threads} thread(s), {a.dtype}; sequential read (sum of 400 MB): {seq_gbs:.1f} GB/s; "
          f"{a.layers} layers x {a.blocks} blocks ({a.layers * caches[0].nbytes / 2**20:.0f} MiB)")
    names = a.isa.split(",") if a.isa else cpu_attention.supported_isas() + ["torch"]
    rng = np.random.default_rng(0)
    for ctx in (int(c) for c in a.ctx.split(",")):
        nblk = -(-ctx // bs)
        if a.batch * nblk > a.blocks:
            raise SystemExit(f"--blocks {a.blocks} < batch x blocks per request ({a.batch * nblk})")
        table = torch.from_numpy(rng.permutation(a.blocks)[: a.batch * nblk].reshape(a.batch, nblk)
                                 .astype(np.int32))
        query = torch.randn(a.batch, hq, d).to(dt)
        qsl = np.arange(a.batch + 1, dtype=np.int64)
        lens = np.full(a.batch, ctx, dtype=np.int64)
        plan = cpu_attention._StepPlan(table, qsl, lens, *([0] if a.no_split else []))
        gb = a.batch * ctx * hkv * d * caches[0].element_size() * 2 / 1e9
        row = [f"ctx {ctx}:"]
        for name in names:
            if name == "torch":
                def attend(c: torch.Tensor) -> object:
                    return torch_attention.paged_attention_torch(query, c, table, qsl, lens, 0.125)
            else:
                cpu_attention.select_isa(name)

                def attend(c: torch.Tensor) -> object:
                    return cpu_attention.paged_attention_cpu(query, c, table, qsl, lens, 0.125, plan)
            s = _median_s(lambda: [attend(c) for c in caches], a.rounds, a.layers)
            row.append(f"{name if name == 'torch' else 'cpu/' + name} {s * 1e3:.3f} ms/layer {gb / s:.1f} GB/s")
        print("  ".join(row))
    cpu_attention.select_isa("auto")


if __name__ == "__main__":
    main()
