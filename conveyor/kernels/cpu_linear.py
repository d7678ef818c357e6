"""Small-M linears on CPU (``csrc/linear_cpu.cpp``), decode-sized M over the
layer's weights, so that a layer holds one copy of its weights wherever a
second does not buy speed (BENCHMARKS.md, "one weight copy"):

* ``plain_linear``: over the parameter as it is ([n][k], no copy), tiles of
  up to 4 rows x 6 columns (AVX-512; AVX2 12 sums) of per-lane sums; fp32,
  and bf16 where the CPU has vdpbf16ps. Up to PLAIN_ROWS rows (bf16
  PLAIN_ROWS_BF16) it streams the weights at the DRAM bandwidth, fp32
  0.98-1.34x the packed kernel below (1B shapes, Xeon, 2 threads); with more
  rows each x vector feeds too few FMAs and it falls behind.
* ``small_linear``: over a packed copy (``pack``: blocks of 16 output columns,
  k-major inside, so each 64-byte line feeds one FMA per row with that row's x
  broadcast). fp32 from PLAIN_ROWS + 1 to ``small_rows`` rows, where it ran
  1.0-1.8x oneDNN on the plain weight, so the layer packs that copy at its
  first such step, unless the engine's decode steps never have more than
  the plain kernel's rows (``packs``); bf16 from 3 (no vdpbf16ps: 1) to 16 rows
  (vdpbf16ps where the CPU has AVX512_BF16, else widened to fp32 math), except
  on AMX, where oneDNN's packed bf16 ran 2-4x this kernel from 4 rows.

Above those rows fp32 runs oneDNN over the plain weight (0.96-0.99x its packed
copy from 65 to 2048 rows: that copy is not kept). Tables ``avx512bf16``,
``avx512``, ``avx2``, ``portable`` chosen by cpuid in one build, as the
attention kernels.

Like the model's other CPU-native ops it follows the backend choice: only
when the cpu attention backend has loaded the extension
(``cpu_attention.loaded()``), with the table family that backend selected
(``model.cpu_isa``); a run on the torch backend keeps oneDNN.
"""
from __future__ import annotations

import functools
import re

import torch

from . import cpu_attention, huge_pages

# bf16 rows up to which the packed kernel runs (above: oneDNN's packed GEMM).
SMALL_ROWS = 16
# Rows up to which the plain kernel runs: fp32 (every engine table), bf16
# (avx512bf16 only). bf16 against oneDNN's packed AMX GEMM (1B shapes, Xeon, 2
# threads): 1.16x at 1 row, 1.06x at 2, 0.96x at 3.
PLAIN_ROWS = 4
PLAIN_ROWS_BF16 = 2
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


# fp32 rows up to which the packed kernel runs. Against oneDNN over the plain
# weight (Xeon, 2 threads), time ratio at 48 / 64 / 80 rows: the MoE bench
# model's qkv, o and lm_head 1.19 / 1.08 / 1.07, the 30M's linears 1.34 / 1.03 /
# 0.97, the 0.5B's 1.18 / 0.97 / 1.00, the 1B's 1.11 / 0.93 at 64; the AVX2
# table (oneDNN capped to AVX2) 1.15x at 32 rows, 0.96x at 64.
SMALL_ROWS_F32 = 64


# fp32 rows above which a linear may run MKL's sgemm (F.linear) instead of
# oneDNN, where ``mkl_avx512``. MKL needs no row bucketing (oneDNN keeps a
# primitive per row count, so the engine pads its rows to a multiple of 64
# there): at row counts oneDNN pads, MKL ran 1.02-1.21x bucketed oneDNN (300-
# 2048 rows, cold weights, Xeon, 2 threads, 14 prefill shapes of the bench
# models); at multiples of 64 it ran 0.86-1.06x at 512 rows (behind on the
# wide gate_up shapes), 0.99-1.14x at 1024, 0.97-1.22x at 2048. At 96-256
# rows oneDNN is ahead (0.86-1.16x). BENCHMARKS.md, "Prefill linears".
MKL_ROWS_F32 = 256
MKL_ALIGNED_ROWS_F32 = 1024  # rows oneDNN runs unpadded go to MKL from here on


@functools.cache
def mkl_avx512() -> bool:
    """Whether torch's MKL takes its AVX-512 path here: an Intel CPU with
    AVX-512 (on AMD, MKL runs its AVX2 code, 2.5x slower than oneDNN)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    flags = re.search(r"^flags\s*:(.*)$", head, re.M)
    return "GenuineIntel" in head and flags is not None and " avx512f" in flags.group(1)


def f32_on_mkl(m: int, padded: bool) -> bool:
    """Whether an fp32 linear of ``m`` rows runs MKL rather than oneDNN, which
    would run it on ``padded`` rows (more than m: its row bucketing)."""
    return mkl_avx512() and m > MKL_ROWS_F32 and (padded or m >= MKL_ALIGNED_ROWS_F32)


@functools.cache
def amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 GEMMs use them)."""
    return hasattr(torch.cpu, "_is_amx_tile_supported") and bool(torch.cpu._is_amx_tile_supported())


def plain_rows(isa: str, dtype: torch.dtype) -> int:
    """The most rows the engine runs on table ``isa`` in ``dtype`` with the
    plain kernel (0: never; bf16 only with vdpbf16ps)."""
    if dtype == torch.float32:
        return PLAIN_ROWS
    return PLAIN_ROWS_BF16 if isa == "avx512bf16" else 0


def packs(isa: str | None, dtype: torch.dtype, decode_rows: int | None) -> bool:
    """Whether a layer may pack a copy of its ``dtype`` weights (this kernel's
    or oneDNN's): not where its engine's decode steps (at most ``decode_rows``
    rows: max_num_seqs, times 1 + the draft tokens when speculating; None:
    unknown) fit the plain kernel of table ``isa`` (None: no kernel). Such an
    engine runs its prefill chunks on the weight itself (fp32 oneDNN, bf16
    F.linear), so a batch-1 engine holds its weights once."""
    return isa is None or decode_rows is None or decode_rows > plain_rows(isa, dtype)


def small_rows(isa: str, dtype: torch.dtype, decode_rows: int | None = None) -> int:
    """The most rows the engine runs on table ``isa`` in ``dtype`` with the
    packed kernel, from plain_rows + 1 on (0: never; see ``packs``)."""
    if not packs(isa, dtype, decode_rows):
        return 0
    if dtype == torch.float32:
        return SMALL_ROWS_F32
    return 0 if amx() else SMALL_ROWS


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
    blocks = packed_view(w)
    if w.device.type != "cpu":
        return blocks.contiguous()
    return huge_pages.empty(blocks.shape, blocks.dtype).copy_(blocks)  # decode streams it


def packed_view(w: torch.Tensor) -> torch.Tensor:
    """``pack(w)``'s layout as a strided view of a padded copy of w (not yet
    contiguous): for callers that write it into storage of their own."""
    n, k = w.shape
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, k + (k % 2 if w.dtype == torch.bfloat16 else 0)
    w = torch.nn.functional.pad(w.detach(), (0, kp - k, 0, np_ - n))
    if w.dtype == torch.bfloat16:
        return w.view(np_ // BLOCK_N, BLOCK_N, kp // 2, 2).permute(0, 2, 1, 3)
    return w.view(np_ // BLOCK_N, BLOCK_N, kp).permute(0, 2, 1)


def small_linear(x: torch.Tensor, packed: torch.Tensor, n: int, b: torch.Tensor | None,
                 isa: str) -> torch.Tensor:
    """x [M, K] @ w[n, K]^T (+ b) with ``packed = pack(w)``: fp32 or bf16 (x
    and w alike); fp32 sums, a bf16 output rounded once."""
    return torch.ops.conveyor_linear.linear(x, packed, n, b, isa)


def plain_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, isa: str) -> torch.Tensor:
    """x [M <= 4, K] @ w[n, K]^T (+ b) over w as it is (rows contiguous):
    fp32, or bf16 on ``avx512bf16`` (fp32 sums, rounded once)."""
    return torch.ops.conveyor_linear.linear_plain(x, w, b, isa)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack's inverse for fp32/int8: [N/16, K, 16] -> w [n, K] (a view's copy)."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n]


def dequant_i8(packed: torch.Tensor, n: int, scale: torch.Tensor) -> torch.Tensor:
    """``unpack(packed, n).float() * scale[:, None]`` in one pass: fp32 [n, K]."""
    return torch.ops.conveyor_linear.dequant_i8(packed, n, scale)


def linear_i8_tiled(x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                    b: torch.Tensor | None, isa: str) -> torch.Tensor:
    """``x @ dequant_i8(packed, n, scale)^T (+ b)`` for prefill-sized x [M, K]
    fp32, never the whole fp32 weight at once: the same weight values, on the
    isa's int8 GEMM (AVX-512: each panel widened in cache) or else dequantized
    a cache-sized tile of columns at a time for torch's fp32 GEMM. ``isa``:
    the kernel table's name."""
    return torch.ops.conveyor_linear.linear_i8_tiled(x, packed, n, scale, b, isa)


def small_linear_i8(x: torch.Tensor, packed: torch.Tensor, n: int, scale: torch.Tensor,
                    b: torch.Tensor | None, isa: str) -> torch.Tensor:
    """Weight-only int8: x [M, K] fp32 @ (q * scale[:, None])^T (+ b) with
    ``packed = pack(q)``; fp32 sums times the column's scale, fp32 out."""
    return torch.ops.conveyor_linear.linear_i8(x, packed, n, scale, b, isa)
