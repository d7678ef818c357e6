"""Small-M linears on CPU (``csrc/linear_cpu.cpp``): decode batches of up to
``small_rows`` rows over the weight packed once (``pack``: blocks of 16 output
columns, k-major inside, so a call streams the weight once in address order
and each 64-byte line feeds one FMA per row).

oneDNN's packed linears (``conveyor.parallel.layers.linear``) are near the FMA peak for
prefill-sized M but reach half of it at M = 16, where each decode step streams
every weight once: this kernel ran the 1B shape's M = 16 linears 1.3-1.4x
faster (BENCHMARKS.md, "Small-M linears"). The packed copy is held next to
oneDNN's (prefill keeps that one): one more copy of the linears' weights. fp32 and bf16 (bf16
through vdpbf16ps where the CPU has AVX512_BF16, else widened to fp32 math);
tables ``avx512bf16``, ``avx512``, ``avx2``, ``portable`` chosen by cpuid in
one build, as the attention kernels.

The engine routes every table of ENGINE_ISAS up to ``small_rows`` rows:
SMALL_ROWS, fp32 on AVX-512 up to 64, and every row count for fp32 on the AVX2 table. There, with x
read in place and the rows in L2-sized m-blocks, the kernel ran the
Qwen2-0.5B linears 1.23x oneDNN's AVX2 GEMM at 32 rows and 1.03-1.08x from 96
to 2048 (BENCHMARKS.md, "x in place"), so AVX2 fp32 keeps no oneDNN copy of
the weights; bf16 has no packed oneDNN path there. On AVX-512 oneDNN is level
at 32 rows and ahead at 64.

Like the model's other CPU-native ops it follows the backend choice: only
when the cpu attention backend has loaded the extension
(``cpu_attention.loaded()``), with the table family that backend selected
(``model.cpu_isa``); a run on the torch backend keeps oneDNN.
"""
from __future__ import annotations

import sys

import torch

from . import cpu_attention

# Rows up to which the kernel runs (above: oneDNN's packed GEMM).
SMALL_ROWS = 16
DTYPES = (torch.float32, torch.bfloat16)


# Tables the engine routes decode linears to: measured ahead of oneDNN's
# packed GEMM there up to SMALL_ROWS. The portable loops are a reference, far
# behind oneDNN.
ENGINE_ISAS = ("avx512bf16", "avx512", "avx2")


def kernel_isa() -> str | None:
    """The table the engine's linears use, or None: the extension is not
    loaded (torch backend, no compiler) or its table is not one of
    ENGINE_ISAS, and the caller keeps oneDNN. The attention table's
    ``avx512`` takes ``avx512bf16`` where this CPU has it (bf16 weights only;
    fp32 is the same kernel)."""
    ext = cpu_attention.loaded()
    if ext is None:
        return None
    isa = str(ext.isa())
    if isa == "avx512" and "avx512bf16" in _supported():
        isa = "avx512bf16"
    return isa if isa in ENGINE_ISAS else None


# fp32 on the AVX-512 tables: with two column blocks per pass the kernel ran
# 1.02-1.08x oneDNN's packed GEMM at 64 rows and 1.06-1.32x at 32 (qkv 1536 x
# 1024, o 1024 x 1024, lm_head 32000 x 1024; Xeon, 2 threads), 0.87-0.93x at 128.
SMALL_ROWS_AVX512_F32 = 64


def small_rows(isa: str, dtype: torch.dtype) -> int:
    """The most rows the engine runs on table ``isa`` in ``dtype``."""
    if dtype == torch.float32:
        if isa == "avx2":
            return sys.maxsize
        if isa.startswith("avx512"):
            return SMALL_ROWS_AVX512_F32
    return SMALL_ROWS


_SUPPORTED: list[str] = []


def _supported() -> list[str]:
    if not _SUPPORTED:
        _SUPPORTED.extend(torch.ops.conveyor_linear.supported_isas())
    return _SUPPORTED


def supported_isas() -> list[str]:
    """The op's tables this CPU runs, best first (loads the extension)."""
    cpu_attention.load_extension()
    return list(_supported())


BLOCK_N = 16  # output columns per packed block (linear_kernels.h kBlockN)


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 or int8 -> [ceil(N/16), K, 16]; bf16 -> [ceil(N/16),
    ceil(K/2), 16, 2] (pairs of k side by side, vdpbf16ps' operand). Padding is zeros."""
    n, k = w.shape
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, k + (k % 2 if w.dtype == torch.bfloat16 else 0)
    w = torch.nn.functional.pad(w.detach(), (0, kp - k, 0, np_ - n))
    if w.dtype == torch.bfloat16:
        return w.view(np_ // BLOCK_N, BLOCK_N, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.view(np_ // BLOCK_N, BLOCK_N, kp).permute(0, 2, 1).contiguous()


def small_linear(x: torch.Tensor, packed: torch.Tensor, n: int, b: torch.Tensor | None,
                 isa: str) -> torch.Tensor:
    """x [M, K] @ w[n, K]^T (+ b) with ``packed = pack(w)``: fp32 or bf16 (x
    and w alike); fp32 sums, a bf16 output rounded once."""
    return torch.ops.conveyor_linear.linear(x, packed, n, b, isa)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack's inverse for fp32/int8: [N/16, K, 16] -> w [n, K] (a view's copy)."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]


def small_linear_i8(x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                    b: torch.Tensor | None, isa: str) -> torch.Tensor:
    """Weight-only int8: x [M, K] fp32 @ (q * scale[:, None])^T (+ b) with
    ``packed = pack(q)``; fp32 sums times the column's scale, fp32 out."""
    return torch.ops.conveyor_linear.linear_i8(x, packed, n, scale, b, isa)
