#!/usr/bin/env python3
"""The small-M kernel against oneDNN's packed GEMM, interleaved in one process.

For one model's layer linears (qkv, o, gate_up, down; fp32, random weights)
at each row count M: every repeat runs all four through oneDNN
(``mkldnn._linear_pointwise`` over ``_reorder_linear_weight``, as
``conveyor.parallel.layers.linear`` does above the kernel's rows) and through the
kernel (``cpu_linear.small_linear`` on table ``--isa``), alternating which
goes first, so a noisy box slows both alike. Prints each linear's GF/s (the
median over repeats, the first dropped) and the kernel's speed over oneDNN's
on the four together. Freed memory stays in the heap (``keep_freed_memory``,
as the engine runs), so large outputs are not fresh pages each call.

As AVX2-only on an AVX-512 machine: cap oneDNN/ATen first, e.g.
  DNNL_MAX_CPU_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
    .venv/bin/python bench/cpu_linear_ab.py --isa avx2 --model 0.5b --rows 32,256,2048
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.cpu_peak import SHAPES, _layer_linears  # noqa: E402
from conveyor.kernels import cpu_linear  # noqa: E402
from conveyor.kernels.cpu_attention import keep_freed_memory  # noqa: E402

NAMES = ("qkv", "o", "gate_up", "down")


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """(N, K) of a layer's four linears, from cpu_peak's (K, N) table."""
    kn = _layer_linears(SHAPES[model])
    return [(kn[name][1], kn[name][0]) for name in NAMES]


def time_rows(m: int, shapes: list[tuple[int, int]], weights: list[tuple[torch.Tensor, torch.Tensor]],
              isa: str, repeats: int) -> dict[str, list[float]]:
    """Per engine, per linear: the median seconds of one call at m rows."""
    xs = {k: torch.randn(m, k) for _, k in shapes}
    runs: dict[str, list[list[float]]] = {"onednn": [[] for _ in shapes], "kernel": [[] for _ in shapes]}
    for r in range(repeats):
        for who in (("onednn", "kernel") if r % 2 == 0 else ("kernel", "onednn")):
            for i, ((n, k), (dnnl, packed)) in enumerate(zip(shapes, weights)):
                t = time.perf_counter()
                if who == "kernel":
                    cpu_linear.small_linear(xs[k], packed, n, None, isa)
                else:
                    torch.ops.mkldnn._linear_pointwise(xs[k], dnnl, None, "none", [None], "")
                runs[who][i].append(time.perf_counter() - t)
    return {who: [statistics.median(t[1:]) for t in per] for who, per in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="32,96,256,2048")
    p.add_argument("--isa", default="auto", help="the kernel's table (cpu_linear.supported_isas())")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    isas = cpu_linear.supported_isas()
    isa = isas[0] if a.isa == "auto" else a.isa
    if isa not in isas:
        raise SystemExit(f"table {isa!r} is not one this CPU runs: {isas}")
    keep_freed_memory()
    shapes = layer_shapes(a.model)
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        weights.append((torch.ops.mkldnn._reorder_linear_weight(w, None), cpu_linear.pack(w)))
    print(f"model {a.model}, kernel table {isa}, {a.threads} threads; GF/s of {', '.join(NAMES)}")
    for m in (int(r) for r in a.rows.split(",")):
        med = time_rows(m, shapes, weights, isa, max(a.repeats, 2))
        for who in ("onednn", "kernel"):
            per = " ".join(f"{2 * m * n * k / t / 1e9:7.1f}" for (n, k), t in zip(shapes, med[who]))
            flops = 2 * m * sum(n * k for n, k in shapes)
            print(f"M={m:5d} {who:>7}: {per}   all {flops / sum(med[who]) / 1e9:7.1f}")
        print(f"M={m:5d} kernel / oneDNN speed: {sum(med['onednn']) / sum(med['kernel']):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
