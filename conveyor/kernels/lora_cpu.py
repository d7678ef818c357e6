"""The fused multi-LoRA CPU op (``csrc/lora_cpu.cpp``): per adapter slot, one
pass over its A and B adds ``x[t] @ A @ B`` into ``y[t]`` in place for the
slot's rows, sub-projections (q/k/v, gate/up) each into their own columns.

Against the torch paths in ``conveyor/workers/lora/mapping.py`` it makes no padded copy
of x, no [rows, N] product, and no gather and add back into y: at decode
those copies were a quarter of the LoRA time, and the adapters' weights are
streamed once per step; at prefill y's rows are read and written once per
row block instead of once per rank-R product (BENCHMARKS.md, "Multi-LoRA").

It is built into the CPU attention extension (``cpu_attention._SOURCES``) and
registered with torch's dispatcher as ``torch.ops.conveyor_lora.lora_add``,
with the same three tables chosen by cpuid (``avx512``, ``avx2``,
``portable``). Like the model's other CPU-native ops it follows the backend
choice: only when the cpu attention backend has loaded the extension
(``cpu_attention.loaded()``), with the table that backend selected
(``model.cpu_isa``); a run on the torch backend stays pure torch.
"""
from __future__ import annotations

import torch

from . import cpu_attention


def kernel_isa() -> str | None:
    """The kernel table the op runs now, or None: the extension is not loaded
    (torch backend, no compiler), and the caller keeps its torch path."""
    ext = cpu_attention.loaded()
    return None if ext is None else str(ext.isa())


def supported_isas() -> list[str]:
    """The LoRA op's tables this CPU runs, best first (loads the extension)."""
    cpu_attention.load_extension()
    return list(torch.ops.conveyor_lora.supported_isas())


def lora_add(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, bs: list[torch.Tensor],
             offsets: list[int], rows: torch.Tensor, segs: torch.Tensor, isa: str) -> None:
    """y[t, off_i:off_i + N_i] += (x[t] @ a_t[s])[:, i*R:(i+1)*R] @ bs[i][s] for
    every segment (start, end, s) of ``segs`` and t in rows[start:end].
    fp32; x [T, K] and y [T, *] with contiguous columns; a_t [S+1, K, n*R] and
    bs[i] [S+1, R, N_i] contiguous; rows int64 [n]; segs int64 [G, 3]."""
    torch.ops.conveyor_lora.lora_add(x, y, a_t, bs, offsets, rows, segs, isa)
