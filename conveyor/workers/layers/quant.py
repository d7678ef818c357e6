"""Weight-only int8 (``model.quantization: int8``) for decode-bound CPU serving.

At load every linear layer's fp32 weight becomes int8 with one fp32 scale per
output channel (``scale = max|w_row| / 127``, round to nearest), and the fp32
copy is dropped: a quarter of the bytes to read per decode step. Activations
stay fp32 and so does the math: decode-sized inputs (``<= INT8_KERNEL_ROWS``
rows) go to the small-M kernel's int8 table (``conveyor/kernels/cpu_linear.py``: the
weight packed in 16-column blocks, converted in registers); larger ones
(prefill chunks, compute-bound) take the same fp32 weight values another
way: up to ``INT8_TILED_ROWS`` rows, on AVX-512 an int8 GEMM that widens each
panel of the weight in cache (``linear_kernels.h``), elsewhere the weight
dequantized a cache-sized tile of columns at a time for the fp32 GEMM; above
that the whole weight is dequantized once for the fp32 GEMM. Embeddings
stay fp32. The lm_head (often the embedding's storage) gets an int8 copy for
decode rows, where it is a third of a small model's bytes per step, and keeps
its fp32 weight for larger batches (dequantizing the vocabulary per call would
cost more than it saves).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu_attention, cpu_linear

# Up to this many input rows the int8 kernel (weight bytes bound) beats a
# dequantize + fp32 GEMM (bench/cpu_peak.py --int8).
INT8_KERNEL_ROWS = 16
# Up to this many rows cpu_linear.linear_i8_tiled, which never writes the whole
# fp32 weight (1B shapes against dequantize + GEMM, Xeon, 2 threads: tiles
# 1.3-2.3x at 128 rows, 1.0-1.33x at 512; the AVX-512 int8 GEMM 1.3x the tiles
# at 64 rows, 1.0-1.2x at 512); above, the GEMM's rows amortize a whole fp32
# weight written once per call (at 2048 rows it ran 1.0-1.15x both).
INT8_TILED_ROWS = 1024


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N]); an all-zero row gets scale 1."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear(x: torch.Tensor, bias: torch.Tensor | None, *, packed: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> x @ (q * scale)^T + bias, fp32, with ``packed =
    cpu_linear.pack(q)`` (the small-M kernel's layout, its int8 table)."""
    n = scale.numel()
    if cpu_attention.loaded() is None:
        w = cpu_linear.unpack(packed, n).float() * scale[:, None]
    elif x.dim() == 2 and x.shape[0] <= INT8_KERNEL_ROWS and x.dtype == torch.float32:
        return cpu_linear.small_linear_i8(x, packed, n, scale, bias, cpu_linear.kernel_isa() or "portable")
    elif x.dim() == 2 and x.shape[0] <= INT8_TILED_ROWS and x.dtype == torch.float32:
        return cpu_linear.linear_i8_tiled(x, packed, n, scale, bias, cpu_linear.kernel_isa() or "portable")
    else:
        w = cpu_linear.dequant_i8(packed, n, scale)  # the same values in one pass
    return F.linear(x, w.to(x.dtype), bias)


def head_int8_linear(x: torch.Tensor, bias: torch.Tensor | None, *, packed: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor | None:
    """The lm_head's int8 path: decode rows on the int8 kernel; None for the
    rest (conveyor.parallel.layers.linear then runs the head's fp32 weight)."""
    if x.dim() == 2 and x.shape[0] <= INT8_KERNEL_ROWS and x.dtype == torch.float32:
        return int8_linear(x, bias, packed=packed, scale=scale)
    return None


def quantize_linears(model: nn.Module) -> int:
    """Quantize every linear layer of ``model`` in place (see the module doc);
    returns how many. Needs the CPU kernels (the cpu attention backend)."""
    from conveyor.parallel.layers import ParallelLMHead, _LinearBase

    if cpu_attention.loaded() is None:
        raise RuntimeError("quantization: int8 needs the cpu attention backend's kernels "
                           f"({cpu_attention.build_error() or 'set model.attention_backend: cpu'})")
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        head = isinstance(module, ParallelLMHead)
        if not (head or isinstance(module, _LinearBase)) or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        if w.dtype != torch.float32:
            raise RuntimeError(f"quantization: int8 quantizes fp32 weights (dtype float32), got {w.dtype}")
        q, scale = quantize_int8(w)
        # conveyor.parallel.layers.linear calls it (conveyor/parallel/ never imports conveyor/workers/).
        forward = head_int8_linear if head else int8_linear
        module.__dict__["_quantized_forward"] = functools.partial(forward, packed=cpu_linear.pack(q), scale=scale)
        if not head:
            module.weight.data = torch.empty(0, dtype=w.dtype)  # the fp32 copy is not read again
        count += 1
    return count
