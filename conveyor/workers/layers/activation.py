"""Gated activation for the fused gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu_attention


class SiluAndMul(nn.Module):
    """[..., 2d] = [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With the CPU kernels loaded (the cpu backend), fp32 and bf16 rows take
        # one native pass into a contiguous output (bf16: fp32 math, one
        # rounding): the in-place torch form below ran silu, mul and then a
        # copy for the down projection's strided input.
        ext = cpu_attention.loaded()
        if (ext is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and x.dim() == 2
                and x.is_contiguous() and not x.requires_grad):
            return ext.silu_and_mul(x)
        d = x.shape[-1] // 2
        gate = x[..., :d]
        # x is the fresh gate_up output, used nowhere else: silu in place.
        return F.silu(gate, inplace=True).mul_(x[..., d:]) if not x.requires_grad else F.silu(gate) * x[..., d:]
