"""Paged-attention benchmark: Triton kernels vs torch SDPA (flash) on a GPU.

Shapes: bf16, 32 query heads, 8 KV heads, head size 128, cache block 16.
Decode at batch 1/16/64/256 x context 1k/4k/16k, plus one mixed batch (prefill
chunks with cached prefixes + decodes). For each: median time over CUDA-event
timed runs (L2 flushed before each), KV bytes read (each request's K and V
once; prefill tiles re-read KV, so for the mixed batch this is an effective
figure), GB/s, and GB/s as a fraction of the device-to-device copy bandwidth
(read + write bytes of a large ``copy_``). The peer is SDPA with the flash
backend on contiguous ``[B, Hkv, S, D]`` K/V (GQA via ``enable_gqa``).

Usage: python bench/attention.py [--quick]   (needs CUDA)
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 4096, 16384)


@dataclass
class Row:
    """One measured case: KV bytes read, each kernel's median ms, a note."""
    name: str
    kv_bytes: int
    triton_ms: float
    sdpa_ms: float | None
    note: str


def _flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def time_ms(fn: Callable[[], object], flush: torch.Tensor, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` with the L2 flushed before every run."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        # Keep the GPU busy while the host enqueues fn(): otherwise a small case
        # times the launch overhead, not the kernel (private but long-standing API).
        torch.cuda._sleep(200_000)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth_gbs(flush: torch.Tensor) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), GB/s."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush, iters=10)
    src = dst = torch.empty(0)  # frees the 4 GiB before the next measurement
    return 2 * n / (ms * 1e-3) / 1e9


def _paged_batch(seq_lens: list[int], q_lens: list[int]) -> dict:
    """Random paged cache (blocks shuffled) + metadata for the given requests."""
    nblk = [-(-s // BS) for s in seq_lens]
    num_blocks = 1 + sum(nblk)
    cache = torch.randn(num_blocks, 2, BS, HKV, D, device="cuda", dtype=DTYPE)
    perm = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    table = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device="cuda")
    used = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[used: used + n]
        used += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    query = torch.randn(int(sum(q_lens)), HQ, D, device="cuda", dtype=DTYPE)
    return dict(cache=cache, table=table, qsl=qsl, query=query,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                max_q=max(q_lens), max_s=max(seq_lens))


def _triton_fn(b: dict) -> Callable[[], torch.Tensor]:
    from conveyor.kernels.paged_attention import paged_attention

    out = torch.empty_like(b["query"])
    return lambda: paged_attention(b["query"], b["cache"], b["qsl"], b["seq_lens"], b["table"],
                                   D ** -0.5, max_query_len=b["max_q"], max_seq_len=b["max_s"], out=out)


def _sdpa_fn(parts: list[tuple[int, int, int]]) -> Callable[[], None]:
    """SDPA (flash) peer: one call per (batch, q_len, kv_len) group on contiguous K/V.

    Prefill groups use a lower-right causal mask (queries are the last q_len
    positions of kv_len), matching the paged kernel's semantics.
    """
    calls = []
    for batch, q_len, kv_len in parts:
        q = torch.randn(batch, HQ, q_len, D, device="cuda", dtype=DTYPE)
        k = torch.randn(batch, HKV, kv_len, D, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        mask = causal_lower_right(q_len, kv_len) if q_len > 1 else None
        calls.append((q, k, v, mask))

    def run() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for q, k, v, mask in calls:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return run


def _peer_ms(parts: list[tuple[int, int, int]], flush: torch.Tensor) -> tuple[float | None, str]:
    try:
        fn = _sdpa_fn(parts)
        return time_ms(fn, flush), ""
    except Exception as exc:  # noqa: BLE001 - flash may reject a shape; the peer never kills our rows
        torch.cuda.empty_cache()
        return None, f"sdpa n/a: {str(exc).splitlines()[0][:60]}"


def _kv_bytes(seq_lens: list[int]) -> int:
    return sum(seq_lens) * HKV * D * 2 * torch.tensor([], dtype=DTYPE).element_size()


def bench_decode(batch: int, ctx: int, flush: torch.Tensor) -> Row:
    """Decode at batch x ctx: the Triton kernel against SDPA (flash) on the same KV."""
    from conveyor.kernels.paged_attention import choose_num_segments

    b = _paged_batch([ctx] * batch, [1] * batch)
    tri = time_ms(_triton_fn(b), flush)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    segs = choose_num_segments(batch, HKV, 1, ctx, BS, sms)
    del b
    torch.cuda.empty_cache()
    peer, note = _peer_ms([(batch, 1, ctx)], flush)
    torch.cuda.empty_cache()
    path = f"split-kv x{segs}" if segs > 1 else "unified"
    return Row(f"decode b={batch} ctx={ctx}", _kv_bytes([ctx] * batch), tri, peer,
               f"{path} {note}".strip())


def bench_mixed(flush: torch.Tensor) -> Row:
    """4 prefill chunks of 1024 tokens after a 3072-token prefix + 64 decodes at 4k."""
    n_pre, chunk, prefix, n_dec, dec_ctx = 4, 1024, 3072, 64, 4096
    seq_lens = [prefix + chunk] * n_pre + [dec_ctx] * n_dec
    q_lens = [chunk] * n_pre + [1] * n_dec
    b = _paged_batch(seq_lens, q_lens)
    tri = time_ms(_triton_fn(b), flush)
    del b
    torch.cuda.empty_cache()
    peer, note = _peer_ms([(n_pre, chunk, prefix + chunk), (n_dec, 1, dec_ctx)], flush)
    name = f"mixed {n_pre}x{chunk}(+{prefix}) + {n_dec}x{dec_ctx}"
    # Prefill tiles read the cache once per query tile: the GB/s of this row is
    # an effective figure (unique KV bytes / time), not the traffic.
    return Row(name, _kv_bytes(seq_lens), tri, peer, f"unified, effective BW {note}".strip())


def _cells(row: Row, copy_gbs: float) -> list[str]:
    gbs = row.kv_bytes / (row.triton_ms * 1e-3) / 1e9
    cells = [row.name, f"{row.kv_bytes / 1e6:.1f}", f"{row.triton_ms:.3f}", f"{gbs:.0f}",
             f"{gbs / copy_gbs:.1%}"]
    if row.sdpa_ms is None:
        cells += ["-"] * 4
    else:
        pg = row.kv_bytes / (row.sdpa_ms * 1e-3) / 1e9
        cells += [f"{row.sdpa_ms:.3f}", f"{pg:.0f}", f"{pg / copy_gbs:.1%}",
                  f"{row.sdpa_ms / row.triton_ms:.2f}"]
    return cells + [row.note]


COLUMNS = ["case", "KV MB", "tri ms", "tri GB/s", "%copy", "sdpa ms", "sdpa GB/s", "%copy",
           "sdpa/tri", "path"]


def _md(cells: list[str]) -> str:
    """A BENCHMARKS.md table row."""
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    """Every decode case and the mixed batch; the table in markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1/64 x ctx 1k/16k only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU (none found); nothing to do.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to benchmark the compiled kernels.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    flush = _flush_buffer()
    copy_gbs = copy_bandwidth_gbs(flush)
    lines = [f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
             f"d2d copy bandwidth {copy_gbs:.0f} GB/s (read+write)",
             f"bf16, Hq={HQ}, Hkv={HKV}, D={D}, block={BS}; sdpa/tri > 1 means Triton is faster", "",
             _md(COLUMNS), _md(["---"] + ["---:"] * 8 + ["---"])]
    print("\n".join(lines), flush=True)
    batches, contexts = ((1, 64), (1024, 16384)) if args.quick else (BATCHES, CONTEXTS)
    cases = [lambda b=b, c=c: bench_decode(b, c, flush) for b in batches for c in contexts]
    for case in cases + [lambda: bench_mixed(flush)]:
        lines.append(_md(_cells(case(), copy_gbs)))
        print(lines[-1], flush=True)  # row by row: a late failure keeps the rows before it
    out = os.environ.get("OUT")
    if out:  # the device tool brings back what is written under $OUT
        with open(os.path.join(out, "attention.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
