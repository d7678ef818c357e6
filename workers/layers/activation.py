"""Gated activation for the fused gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] = [gate | up] -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = x[..., :d]
        # x is the fresh gate_up output, used nowhere else: silu in place.
        return F.silu(gate, inplace=True).mul_(x[..., d:]) if not x.requires_grad else F.silu(gate) * x[..., d:]
