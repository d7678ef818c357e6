"""Which decode-sized linears DecodeStack (conveyor/workers/models/decode_stack.py)
runs in its native call, decided once per layer: ``csrc/decode_layers.cpp``
routes each projection's rows as ``linear`` would (``decode_rows`` says how
many rows it takes), so the stack only has to know that a layer is one of
the kinds it routes and hand over the layer's packed copies per step
(``layers.small_packed``)."""
from __future__ import annotations

from typing import Any

import torch

from conveyor.kernels import cpu_linear
from conveyor.parallel import state
from conveyor.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    decode_rows_of,
)


def decode_rows(dtype: torch.dtype, decode_rows_marked: int | None) -> int:
    """The most rows the native call takes for ``dtype``: those of the plain
    kernel, then the packed kernel's (``linear``'s first two paths); 0 without
    the kernels."""
    isa = cpu_linear.kernel_isa()
    if isa is None or dtype not in cpu_linear.DTYPES:
        return 0
    return max(cpu_linear.plain_rows(isa, dtype), cpu_linear.small_rows(isa, dtype, decode_rows_marked))


def routable(module: Any, dtype: torch.dtype, rows: int) -> bool:
    """Whether decode_layers.cpp runs ``module``'s inputs of up to ``rows``
    rows of ``dtype`` on one TP rank as ``linear`` would: a quantized layer
    (fp32: its int8 kernel, past that the prefill-sized op), else the plain
    kernel on the weight and, past its rows, the packed kernel on the layer's
    packed copy. False where such a call would take another path (more rows
    than ``decode_rows``, no kernel table, another dtype, a module that is not
    one of these classes, e.g. a LoRA wrapper, several TP ranks)."""
    if type(module) not in (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                            RowParallelLinear) or state.tp_size() != 1:
        return False
    if "_quantized_forward" in module.__dict__:  # its own forward routes every row count
        return dtype == torch.float32
    isa = cpu_linear.kernel_isa()
    return isa is not None and module.weight.dtype == dtype and rows <= decode_rows(dtype, decode_rows_of(module))

