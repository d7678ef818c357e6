"""RMSNorm with the fused residual-add form used between decoder sub-blocks."""
from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import cpu_attention
from conveyor.parallel.layers import default_weight_loader, make_param


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in fp32 and cast back (as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), dtype, default_weight_loader)
        self.weight.data.fill_(1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); with no residual,
        (norm(x), x) — the second value is the residual stream to carry on."""
        ext = cpu_attention.loaded()
        if ext is not None and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() \
                and x.dtype == self.weight.dtype and (residual is None or residual.dtype == x.dtype):
            out, x = ext.rms_norm(x, residual, self.weight, self.eps)  # one pass over each row
            return out, x
        if residual is not None:
            x = x + residual  # in the model dtype, like the unfused HF form
        return self._norm(x), x
