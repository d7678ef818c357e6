"""Decode-sized linears bound once per layer (DecodeStack,
conveyor/workers/models/decode_stack.py): the call ``linear`` would make for
any input of up to so many rows, decided when the stack is built instead of at
every call."""
from __future__ import annotations

from collections.abc import Callable
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
    packed_small_linear,
)


def decode_rows(dtype: torch.dtype, decode_rows_marked: int | None) -> int:
    """The most rows ``decode_linear`` binds for ``dtype``: those of the plain
    kernel, then the packed kernel's (``linear``'s first two paths); 0 without
    the kernels."""
    isa = cpu_linear.kernel_isa()
    if isa is None or dtype not in cpu_linear.DTYPES:
        return 0
    return max(cpu_linear.plain_rows(isa, dtype), cpu_linear.small_rows(isa, dtype, decode_rows_marked))


def decode_linear(module: Any, dtype: torch.dtype, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``module.forward`` for inputs of at most ``rows`` rows of ``dtype`` on
    one TP rank, with ``linear``'s routing decided now instead of per call: a
    quantized layer's own forward, else the plain kernel on the weight and,
    past its rows, the packed kernel on the layer's packed copy (the weight
    and the copy are looked up at each call, so a reload is seen). None where
    such a call would take another path (more rows than ``decode_rows``, no
    kernel table, another dtype, a module that is not one of these classes,
    e.g. a LoRA wrapper, several TP ranks)."""
    if type(module) not in (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                            RowParallelLinear) or state.tp_size() != 1:
        return None
    quantized = module.__dict__.get("_quantized_forward")
    isa = cpu_linear.kernel_isa()
    if quantized is not None:  # its own forward routes every row count
        if dtype != torch.float32:
            return None
        call: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] = quantized
    elif isa is not None and module.weight.dtype == dtype and rows <= decode_rows(dtype, decode_rows_of(module)):
        plain = cpu_linear.plain_rows(isa, dtype)

        def call(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            w = module.weight
            if x.shape[0] <= plain:
                return cpu_linear.plain_linear(x, w, b, isa)
            return packed_small_linear(module, x, w, b, isa)
    else:
        return None
    if isinstance(module, RowParallelLinear):  # its bias is added after the (here absent) all-reduce
        def row(x: torch.Tensor) -> torch.Tensor:
            y = call(x, None)
            return y if module.bias is None else y + module.bias
        return row
    return lambda x: call(x, module.bias)
