"""A mixture-of-experts layer's experts on CPU in one op (``csrc/moe_cpu.cpp``).

The per-expert loop (``conveyor/workers/layers/moe.py``) paid, per expert with
tokens, a gather, two linears, the activation and an ``index_add_`` from Python,
about 8.5-9.3 ms a decode step over 8 layers of 16 experts, and each linear
was its own parallel region that streamed one expert's weights at 9-12 GB/s.
This op sorts the (token, expert) pairs once, runs every expert's gate/up
GEMM in one parallel region (the small-M kernels of ``cpu_linear`` over each
expert's packed blocks, the blocks split over the threads by cost), the
activation, every down GEMM in one more, and sums each token's outputs
weighted by the router in ascending expert order. Per expert the arithmetic
is the small-M linear's, so it agrees with the loop bit for bit where the loop
runs that kernel.

The weights are packed once per layer (``pack_experts``): one more copy of the
experts next to the layer's parameters.
"""
from __future__ import annotations

import torch

from . import cpu_linear, huge_pages

# Mean rows per expert up to which the grouped op runs on each table and
# dtype; above, the per-expert loop's oneDNN GEMMs (AVX-512: ahead from ~64
# fp32 rows, and from ~24 bf16 rows on AMX). Xeon (AMX), 16 experts, top-4,
# hidden 1024, intermediate 512, 2 threads, loop / grouped: fp32 1.76x at 16
# mean rows, 1.18x at 48, 1.00x at 64; bf16 1.52x at 16, 0.89x at 24
# (BENCHMARKS.md, "mixture of experts"). The AVX2 table's small-M kernel runs
# every fp32 row count (cpu_linear.small_rows), so the grouped op does too.
_MEAN_ROWS = {("avx512", torch.float32): 48, ("avx512bf16", torch.float32): 48,
              ("avx512", torch.bfloat16): 16, ("avx512bf16", torch.bfloat16): 16}


def kernel_for(isa: str, dtype: torch.dtype, pairs: int, num_experts: int) -> str | None:
    """The op's kernel for a call with ``pairs`` (token, expert) pairs over
    ``num_experts`` experts on table ``isa``: "amx" for bf16 where the CPU has
    AMX (ahead of the per-expert oneDNN loop at every row count: 3.5x at 64
    tokens, 1.5x at 1024, BENCHMARKS.md), the table up to its mean rows per
    expert, or None: the per-expert loop."""
    if dtype == torch.bfloat16 and isa.startswith("avx512") and amx_ready():
        return "amx"
    limit = _MEAN_ROWS.get((isa, dtype))
    return isa if limit is None or pairs <= limit * num_experts else None


_AMX: list[bool] = []


def amx_ready() -> bool:
    """Whether the op may run AMX tiles here (the CPU has AMX-BF16 and the OS
    granted the tile state; asked once)."""
    if not _AMX:
        _AMX.append(bool(torch.ops.conveyor_moe.amx_ready()))
    return _AMX[0]


def pack_experts(w: torch.Tensor) -> torch.Tensor:
    """Stacked expert matrices [E, N, K] -> [E, *cpu_linear.pack(w[e]).shape]."""
    first = cpu_linear.packed_view(w[0])
    out = huge_pages.empty((w.shape[0], *first.shape), first.dtype)  # decode streams it
    out[0].copy_(first)
    for e in range(1, w.shape[0]):  # each expert straight into the stack, no packed copy between
        out[e].copy_(cpu_linear.packed_view(w[e]))
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inter: int,
            topk: tuple[torch.Tensor, torch.Tensor], first_expert: int, isa: str) -> torch.Tensor:
    """x [T, H] fp32/bf16 through the local experts (``w13``/``w2`` from
    ``pack_experts`` of the layer's [E, 2I, H] and [E, H, I] stacks) that
    ``topk`` = (fp32 weights, int64 ids) [T, k] picked -> this rank's partial
    sum [T, H] in x's dtype. Pairs of experts outside [first_expert,
    first_expert + E) are skipped (another rank's). ``isa``: a table of
    cpu_linear, or "amx" (bf16 on AMX tiles where H and I are multiples of
    32, else the best table)."""
    weights, ids = topk
    return torch.ops.conveyor_moe.experts(x, w13, w2, inter, ids, weights, first_expert, isa)
