#!/usr/bin/env python3
"""Where a multi-LoRA step's CPU time goes, op by op, at bench/lora.py's shapes.

Eight decoder layers of the bench's 30M Llama (hidden 512, intermediate 1408,
8 q / 4 kv heads of 64), each with its own base weights (oneDNN-packed, as
conveyor/parallel/layers.py runs them) and its own 16 rank-16 adapters over all seven
projections, so the working set (94 MB base + 76 MB adapters) leaves the
caches as it does in the engine (one layer alone fits and measures ~2x faster).

Two step shapes: decode (64 tokens, token i on slot i % 16: the padded bmm
path) and a prefill step (2048 tokens in runs of 16..128 per adapter: the
runs path). Prints ms per step for the base linears and for each LoRA op of
the torch paths, then of the fused CPU op (conveyor/kernels/lora_cpu.py) on each
kernel table this CPU runs, plus single-thread streaming references (sum
over 77 MB; a 4-row mm).

Usage: OMP_NUM_THREADS=1 python bench/lora_micro.py [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from conveyor.workers.lora.mapping import LoRAMapping, lora_blocks  # noqa: E402

S, R, NUM_LAYERS = 16, 16, 8
SHAPES = {"qkv": (512, [512, 256, 256]), "o": (512, [512]), "gate_up": (512, [1408, 1408]), "down": (1408, [512])}
Layer = dict[str, tuple[torch.Tensor, list, object]]


def make_layer(g: torch.Generator) -> Layer:
    """Per linear: a_t [S+1, K, n*R], the per-sub (rank cols, out cols, B [S+1, R, N_i]), packed W."""
    out: Layer = {}
    for name, (k, outs) in SHAPES.items():
        a_t = torch.randn(S + 1, k, len(outs) * R, generator=g) * 0.02
        a_t[S] = 0
        subs, off = [], 0
        for i, n in enumerate(outs):
            b = torch.randn(S + 1, R, n, generator=g) * 0.02
            b[S] = 0
            subs.append((slice(i * R, (i + 1) * R), slice(off, off + n), b))
            off += n
        w = torch.randn(off, k, generator=g) * 0.02
        out[name] = (a_t, subs, torch.ops.mkldnn._reorder_linear_weight(w, None))
    return out


def base(x: torch.Tensor, packed: object) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


def _step_inputs(token_slots: np.ndarray) -> tuple[LoRAMapping, dict[str, torch.Tensor]]:
    """The step's LoRA mapping and one random input per wrapped linear."""
    mp = LoRAMapping.build(token_slots, S, torch.device("cpu"))
    assert mp is not None
    return mp, {k: torch.randn(token_slots.size, v[0]) for k, v in SHAPES.items()}


def profile(layers: list[Layer], token_slots: np.ndarray, reps: int) -> dict[str, float]:
    """ms per step of each op, the add_lora paths spelled out so each op is timed."""
    mp, xs = _step_inputs(token_slots)
    acc: dict[str, float] = defaultdict(float)
    for it in range(reps + 1):
        for layer in layers:
            for name, (a_t, subs, packed) in layer.items():
                x, t = xs[name], time.perf_counter()
                y = base(x, packed)
                t = _tick(acc, "base linears", t, it)
                if mp.runs is not None:
                    for start, end, slot in mp.runs:
                        shrunk = torch.mm(x[start:end], a_t[slot])
                        t = _tick(acc, f"shrink {name}", t, it)
                        for r, o, b in lora_blocks(None, subs):
                            y[start:end, o].addmm_(shrunk[:, r], b[slot])
                        t = _tick(acc, f"expand {name}", t, it)
                    continue
                xp = x.index_select(0, mp.src_index).view(mp.groups, mp.m, -1)
                t = _tick(acc, "index_select x", t, it)
                shrunk = torch.bmm(xp, a_t[:mp.groups])
                t = _tick(acc, f"shrink {name}", t, it)
                for r, o, b in lora_blocks(None, subs):
                    out = torch.bmm(shrunk[:, :, r], b[:mp.groups])
                    t = _tick(acc, f"expand {name}", t, it)
                    y[:, o].add_(out.view(mp.groups * mp.m, -1).index_select(0, mp.gather_index))
                    t = _tick(acc, "gather + add y", t, it)
    return {k: v / reps * 1e3 for k, v in acc.items()}


def profile_fused(layers: list[Layer], token_slots: np.ndarray, reps: int, isa: str) -> dict[str, float]:
    """ms per step of the base linears and of the fused CPU op (conveyor/kernels/lora_cpu.py) per linear."""
    from conveyor.kernels.lora_cpu import lora_add

    mp, xs = _step_inputs(token_slots)
    offsets = {name: [o.start for _, o, _ in subs] for name, (_, subs, _) in layers[0].items()}
    acc: dict[str, float] = defaultdict(float)
    for it in range(reps + 1):
        for layer in layers:
            for name, (a_t, subs, packed) in layer.items():
                x, t = xs[name], time.perf_counter()
                y = base(x, packed)
                t = _tick(acc, "base linears", t, it)
                lora_add(x, y, a_t, [b for _, _, b in subs], offsets[name], mp.rows, mp.segs, isa)
                t = _tick(acc, f"fused {name}", t, it)
    return {k: v / reps * 1e3 for k, v in acc.items()}


def _tick(acc: dict[str, float], key: str, t0: float, it: int) -> float:
    t = time.perf_counter()
    if it:  # iteration 0 warms up
        acc[key] += t - t0
    return t


def streaming_refs() -> None:
    bufs = [torch.randn(2_400_000) for _ in range(8)]  # 8 x 9.6 MB, like the adapters
    mats = [b.view(50_000, 48) for b in bufs]
    x4 = torch.randn(4, 50_000)
    for label, fn in (("sum over 77 MB", lambda: [b.sum() for b in bufs]),
                      ("mm [4, 50000] @ [50000, 48] x8 (77 MB)", lambda: [torch.mm(x4, m) for m in mats])):
        fn()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        dt = (time.perf_counter() - t) / 10
        print(f"  {label}: {dt * 1e3:.2f} ms, {77e6 / dt / 1e9:.1f} GB/s")


def _fused_isas() -> list[str]:
    """The fused op's kernel tables this CPU runs ([] when the extension does not build)."""
    from conveyor.kernels import cpu_attention

    if not cpu_attention.available():
        return []
    from conveyor.kernels.lora_cpu import supported_isas

    return supported_isas()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    layers = [make_layer(g) for _ in range(NUM_LAYERS)]
    lens = np.random.default_rng(0).integers(16, 129, size=40)
    prefill = np.concatenate([np.full(n, i % S) for i, n in enumerate(lens)])[:2048]
    isas = _fused_isas()
    for label, slots, reps in (("decode, 64 tokens", np.arange(64) % S, args.reps),
                               ("prefill, 2048 tokens", prefill, max(2, args.reps // 10))):
        runs = [("torch ops", profile(layers, slots, reps))]
        runs += [(f"fused op, {isa}", profile_fused(layers, slots, reps, isa)) for isa in isas]
        for path, res in runs:
            lora = sum(v for k, v in res.items() if k != "base linears")
            print(f"{label} ({NUM_LAYERS} layers), {path}, ms per step: base linears {res['base linears']:.2f}, "
                  f"LoRA {lora:.2f} ({lora / res['base linears']:.2f}x)")
            for k, v in sorted(res.items(), key=lambda kv: -kv[1]):
                if k != "base linears":
                    print(f"  {k:16s} {v:7.2f}")
    print("streaming references, one thread:")
    streaming_refs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
