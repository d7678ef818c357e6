#!/usr/bin/env python3
"""This machine's limits and how close the model's linears come to them.

1. fp32 FMA peak: a C loop of independent FMA chains (AVX-512 and AVX2 widths,
   whichever the CPU runs), on one thread and on every core at once: GFLOP/s
   per core.
2. Memory bandwidth: a read (sum) and a copy of 1 GiB, one thread and all, on
   4 KiB pages; the reads again on huge pages where the OS gives them. The
   best all-core read is the figure decode is held to.
3. The linears as the model runs them (``conveyor.parallel.layers.linear``, fp32: with
   ``--small-kernel`` our kernels up to 64 rows, oneDNN on the weight above, MKL where
   cpu_linear.f32_on_mkl says; weights on huge pages as the model's) at M = 1, 16,
   64, 256, 2048 rows for the
   30M (the bench's), Qwen2-0.5B and Llama-3.2-1B shapes: each layer's qkv,
   o, gate_up and down, and the lm_head (M <= 256: the model computes logits
   only for the rows that sample). GFLOP/s, share of the all-core FMA peak
   (prefill MFU) and, at M = 1, the weight bytes read per second as a share of
   the measured read bandwidth (decode bandwidth use). Calls at M <= 16 cycle
   through 512 MiB of distinct weights, so the bytes come from DRAM.
   ``--small-kernel`` loads the CPU extension first, so M up to its row limit takes the
   small-M kernel (conveyor/kernels/cpu_linear.py) as in the engine; without it every
   M runs oneDNN (the "before" of that kernel).

The peak loop is checked: objdump must show 12 FMAs in it, and the core clock
(a chain of dependent 1-cycle adds) turns GFLOP/s into flop per cycle, which
must match the core's FMA width x ports (e.g. 2 x 16 lanes x 2 = 64 on a core
with two 512-bit FMA pipes).

Usage:
  .venv/bin/python bench/cpu_peak.py                       # everything
  .venv/bin/python bench/cpu_peak.py --models 30m --rows 1,2048
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.lib.models import SPECS  # noqa: E402
from conveyor.kernels import huge_pages  # noqa: E402
from conveyor.kernels.cpu_attention import keep_freed_memory  # noqa: E402
from conveyor.parallel.layers import linear  # noqa: E402


def _shape(name: str) -> tuple[int, ...]:
    """(hidden, intermediate, query heads, kv heads, head dim, vocab) of a bench model."""
    c = SPECS[name].config
    return (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), c["vocab_size"])


SHAPES = {name: _shape(name) for name in ("30m", "0.5b", "1b")}

# 12 independent FMA chains per width: enough to cover 4-cycle latency on 2 ports.
# Each chain starts from its own value and the empty asm makes every register an
# opaque input to the next iteration: with equal starts GCC merged the 12 chains
# into one (one vfmadd per iteration, counted as 12: a 12x inflated "peak").
# `_fma_count` checks the compiled loop still holds 12 FMAs.
_FMA_SRC = r"""
#include <immintrin.h>
#define CHAINS(T, SET1, FMA, ADD, RED) \
  T a0 = SET1(0.f), a1 = SET1(1.f), a2 = SET1(2.f), a3 = SET1(3.f), a4 = SET1(4.f), a5 = SET1(5.f), \
    a6 = SET1(6.f), a7 = SET1(7.f), a8 = SET1(8.f), a9 = SET1(9.f), a10 = SET1(10.f), a11 = SET1(11.f); \
  const T b = SET1(1e-7f), c = SET1(0.999999f); \
  for (long i = 0; i < iters; ++i) { \
    a0 = FMA(a0, c, b); a1 = FMA(a1, c, b); a2 = FMA(a2, c, b); a3 = FMA(a3, c, b); \
    a4 = FMA(a4, c, b); a5 = FMA(a5, c, b); a6 = FMA(a6, c, b); a7 = FMA(a7, c, b); \
    a8 = FMA(a8, c, b); a9 = FMA(a9, c, b); a10 = FMA(a10, c, b); a11 = FMA(a11, c, b); \
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), \
                     "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11)); } \
  T s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))); \
  s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11))); \
  float out[sizeof(T) / 4]; RED(out, s); return out[0];

__attribute__((target("avx512f"))) float fma512(long iters) {
  CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps)
}
__attribute__((target("avx2,fma"))) float fma256(long iters) {
  CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps)
}
/* 8 dependent integer adds per iteration, 1 cycle each on every x86 core since
   P6: 8 * iters / seconds is the core clock (no perf counters in a VM). */
float addchain(long iters) {
  long x = 0;
  for (long i = 0; i < iters; ++i)
    __asm__ volatile("add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\t"
                     "add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0" : "+r"(x));
  return (float)x;
}
/* Streaming read of n floats with 4 independent AVX2 sums (memory-bound, not
   add-latency-bound as torch's sum can be): the read bandwidth a GEMV could use. */
__attribute__((target("avx2,fma"))) float read256(const float* p, long n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (long i = 0; i + 32 <= n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(p + i)); s1 = _mm256_add_ps(s1, _mm256_loadu_ps(p + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(p + i + 16)); s3 = _mm256_add_ps(s3, _mm256_loadu_ps(p + i + 24)); }
  float out[8]; _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return out[0];
}
"""


_LIB_PATH: list[str] = []


def _fma_lib() -> ctypes.CDLL:
    d = tempfile.mkdtemp(prefix="cpu_peak_")
    src, lib = os.path.join(d, "fma.c"), os.path.join(d, "fma.so")
    with open(src, "w") as f:
        f.write(_FMA_SRC)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    _LIB_PATH[:] = [lib]
    dll = ctypes.CDLL(lib)  # ctypes drops the GIL during each call
    for name in ("fma512", "fma256", "addchain"):
        getattr(dll, name).argtypes = [ctypes.c_long]
        getattr(dll, name).restype = ctypes.c_float
    dll.read256.argtypes = [ctypes.c_void_p, ctypes.c_long]
    dll.read256.restype = ctypes.c_float
    return dll


def _fma_count(func: str) -> int | None:
    """vfmadd instructions in the compiled function (objdump), or None without
    objdump: 12 means the 12 chains survived the compiler."""
    try:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _LIB_PATH[0]],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None
    body = asm.split(f"<{func}>:", 1)[1].split("\n\n", 1)[0]
    return body.count("vfmadd")


def clock_ghz(dll: ctypes.CDLL) -> float:
    """The core clock under load, from a chain of dependent 1-cycle adds."""
    iters = 100_000_000
    dll.addchain(iters // 10)
    return 8 * iters / min(_parallel_s(lambda: dll.addchain(iters), 1) for _ in range(3)) / 1e9


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _parallel_s(fn: Callable[[], object], threads: int) -> float:
    """Wall time of `threads` threads each running fn once, started together."""
    barrier = threading.Barrier(threads + 1)

    def body() -> None:
        barrier.wait()
        fn()

    ts = [threading.Thread(target=body) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def fma_peak(cores: int) -> tuple[dict[str, tuple[float, float]], float]:
    """(width name -> (GFLOP/s on one core, GFLOP/s per core with all busy),
    core clock GHz)."""
    flags, dll, out = _cpu_flags(), _fma_lib(), {}
    for name, lanes, need in (("avx512", 16, "avx512f"), ("avx2", 8, "fma")):
        if need not in flags:
            continue
        func = "fma512" if lanes == 16 else "fma256"
        count = _fma_count(func)
        if count is not None and count != 12:
            raise RuntimeError(f"{func} compiled to {count} FMAs per iteration, not 12")
        fn, iters = getattr(dll, func), 50_000_000
        flops = iters * 12 * lanes * 2
        fn(iters // 10)
        one = min(_parallel_s(lambda: fn(iters), 1) for _ in range(3))
        alln = min(_parallel_s(lambda: fn(iters), cores) for _ in range(3))
        out[name] = (flops / one / 1e9, flops / alln / 1e9)
    return out, clock_ghz(dll)


def _median_s(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(cores: int) -> dict[str, float]:
    """GB/s: read (torch sum, and a 4-chain AVX2 read loop per thread on its own
    slice) and copy (read + write bytes) of 1 GiB, 1 thread and all; on 4 KiB
    pages, and the read again on advised 2 MiB pages (" huge"), where the
    engine keeps its weights and KV cache (conveyor/kernels/huge_pages.py)."""
    out = _bandwidth(cores, torch.ones(2**28), "")
    huge = huge_pages.empty((2**28,), torch.float32).fill_(1.0)
    if huge_pages.anon_huge_kib() > 0:
        out.update({k: v for k, v in _bandwidth(cores, huge, " huge").items() if "read" in k})
    return out


def _bandwidth(cores: int, x: torch.Tensor, tag: str) -> dict[str, float]:
    y = torch.empty_like(x)
    nbytes, out = x.numel() * 4, {}
    dll = _fma_lib() if "avx2" in _cpu_flags() else None
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        out[f"read x{threads}{tag}"] = nbytes / _median_s(lambda: x.sum(), 5) / 1e9
        out[f"copy x{threads}{tag}"] = 2 * nbytes / _median_s(lambda: y.copy_(x), 5) / 1e9
        if dll is not None:
            part = x.numel() // threads
            ptrs = iter([x.data_ptr() + i * part * 4 for i in range(threads)])
            lock = threading.Lock()

            def one() -> None:
                with lock:
                    ptr = next(ptrs)
                dll.read256(ptr, part)

            def run() -> None:
                nonlocal ptrs
                ptrs = iter([x.data_ptr() + i * part * 4 for i in range(threads)])
                _parallel_s(one, threads)
            out[f"stream-read x{threads}{tag}"] = nbytes / _median_s(run, 5) / 1e9
    torch.set_num_threads(cores)
    return out


def _layer_linears(spec: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    h, i, hq, hkv, d, v = spec
    return {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * i),
            "down": (i, h), "lm_head": (h, v)}


# Decode-sized calls cycle through distinct weights at least this large in all, as
# the model's layers do, so no cache (L3 here: 32 MiB) holds the weight between
# calls and the GB/s at M = 1 is DRAM's.
_COLD_BYTES = 512 << 20


def _time_linear(k: int, n: int, m: int) -> float:
    """Median seconds of one linear [m, k] x [n, k]^T as the model runs it."""
    copies = max(1, min(256, -(-_COLD_BYTES // (k * n * 4)))) if m <= 16 else 1
    holders = [torch.nn.Module() for _ in range(copies)]
    ws = [huge_pages.copy(torch.randn(n, k) * 0.02) for _ in range(copies)]  # as the model's parameters
    x = torch.randn(m, k)
    flops = 2 * m * n * k
    rounds = max(3, min(20, int(2e10 // max(flops, 1))))
    it = iter(range(1 << 62))

    def call() -> None:
        i = next(it) % copies
        linear(holders[i], x, ws[i])

    with torch.inference_mode():
        for _ in range(copies):  # pack every copy before timing
            call()
        return _median_s(call, max(rounds, copies))


def linears(models: list[str], rows: list[int], peak_all: float, read_bw: float) -> None:
    """The models' linears at each row count: GFLOP/s, share of the FMA peak, decode bandwidth use."""
    print(f"\nlinears, fp32, {torch.get_num_threads()} threads (conveyor.parallel.layers.linear); "
          f"% of the all-core FMA peak {peak_all:.0f} GFLOP/s; at M=1 the weight GB/s read "
          f"as % of the {read_bw:.1f} GB/s read bandwidth")
    for model in models:
        lin = _layer_linears(SHAPES[model])
        for m in rows:
            tot_s = tot_flops = tot_bytes = 0.0
            cells = []
            for name, (k, n) in lin.items():
                if name == "lm_head" and m > 256:
                    continue
                s = _time_linear(k, n, m)
                gf = 2 * m * n * k / s / 1e9
                cells.append(f"{name} {gf:.0f}" + (f" ({k * n * 4 / s / 1e9:.1f} GB/s)" if m == 1 else ""))
                if name != "lm_head":
                    tot_s, tot_flops, tot_bytes = tot_s + s, tot_flops + 2 * m * n * k, tot_bytes + k * n * 4
            layer = tot_flops / tot_s / 1e9
            extra = (f", {tot_bytes / tot_s / 1e9:.1f} GB/s = {100 * tot_bytes / tot_s / 1e9 / read_bw:.0f}% "
                     f"of read bw" if m == 1 else "")
            print(f"  {model:5} M={m:<5} layer {layer:6.1f} GFLOP/s = {100 * layer / peak_all:4.1f}% of peak"
                  f"{extra} | " + ", ".join(cells))


def int8_decode(models: list[str], rows: list[int]) -> None:
    """Weight-only int8 (conveyor/workers/layers/quant.py) against the fp32 linear at
    decode-sized M: the per-layer linears' time and speedup."""
    from conveyor.kernels import cpu_attention
    from conveyor.kernels.cpu_linear import pack
    from conveyor.workers.layers.quant import int8_linear, quantize_int8

    cpu_attention.load_extension()
    print(f"\nweight-only int8 vs fp32, kernel table {cpu_attention.isa()}, {torch.get_num_threads()} threads")
    holder = torch.nn.Module()
    for model in models:
        for m in rows:
            t32 = t8 = 0.0
            for name, (k, n) in _layer_linears(SHAPES[model]).items():
                if name == "lm_head":
                    continue
                w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
                q, scale = quantize_int8(w)
                packed = pack(q)
                with torch.inference_mode():
                    t32 += _median_s(lambda: linear(holder, x, w), 10)
                    t8 += _median_s(lambda: int8_linear(x, None, packed=packed, scale=scale), 10)
            print(f"  {model:5} M={m:<3} layer linears fp32 {t32 * 1e3:.3f} ms, int8 {t8 * 1e3:.3f} ms: "
                  f"{t32 / t8:.2f}x")


def main() -> None:
    """The FMA peak, the memory bandwidth, then the linears (and --int8) against them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="30m,0.5b,1b")
    p.add_argument("--rows", default="1,16,64,256,2048")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--int8", action="store_true", help="only the int8-vs-fp32 decode linears (M <= 16)")
    p.add_argument("--small-kernel", action="store_true",
                   help="M up to its row limit (cpu_linear.small_rows) on the small-M kernel "
                        "(conveyor/kernels/cpu_linear.py), as the engine runs it")
    a = p.parse_args()
    if a.int8:
        torch.set_num_threads(a.cores)
        int8_decode([m.strip() for m in a.models.split(",")], [1, 4, 16])
        return
    torch.set_num_threads(a.cores)
    flags = sorted(f for f in _cpu_flags() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    print(f"{a.cores} cores; flags: {' '.join(flags)}")
    peaks, ghz = fma_peak(a.cores)
    print(f"core clock (dependent adds): {ghz:.2f} GHz")
    for name, (one, per_core) in peaks.items():
        print(f"fp32 FMA peak {name} (12 FMAs per loop, objdump-checked): {one:.1f} GFLOP/s on one "
              f"core alone = {one / ghz:.1f} flop/cycle, {per_core:.1f} per core with {a.cores} busy "
              f"({per_core * a.cores:.1f} all)")
    bw = bandwidth(a.cores)
    print("memory bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()))
    best = next(iter(peaks.values()), (0.0, 0.0))
    read_bw = max(v for k, v in bw.items() if k.startswith(("read x", "stream-read x")) and f"x{a.cores}" in k)
    keep_freed_memory()  # as the engine's cpu backend does: no fresh mmap per output
    if a.small_kernel:
        from conveyor.kernels import cpu_attention, cpu_linear

        cpu_attention.load_extension()
        isa = cpu_linear.kernel_isa()
        rows = cpu_linear.small_rows(isa, torch.float32) if isa else 0
        print(f"{'every M' if rows == sys.maxsize else f'M <= {rows}'}: the small-M kernel, table {isa}")
    linears([m.strip() for m in a.models.split(",")], [int(r) for r in a.rows.split(",")],
            best[1] * a.cores, read_bw)


if __name__ == "__main__":
    main()
