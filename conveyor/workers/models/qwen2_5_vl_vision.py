"""Qwen2.5-VL's vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel)
on our TP layers.

An image arrives as the processor's patch rows [t*h*w, C*T*P*P] with its
grid (t, h, w) in patches. The rows go through a Conv3d patch embedding,
are reordered into windows (`window_index`: groups of spatial_merge_size^2
neighbouring patches, laid out window by window), and run through the blocks:
RMSNorm, attention with 2D rotary positions (h and w halves of the head),
full attention over each frame in `fullatt_block_indexes`, attention within
each window elsewhere, and a gated SiLU MLP. The merger (RMSNorm, then an MLP
over each group of merge^2 patches) gives one row per placeholder token;
the window order is undone last. Module names mirror the checkpoint's
(visual.blocks.N.attn.qkv, .mlp.gate_proj, .merger.mlp.0 ...).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


class QwenVisionConfig:
    """vision_config with the defaults of transformers' Qwen2_5_VLVisionConfig."""

    def __init__(self, raw: dict[str, Any] | None) -> None:
        v = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16,
             "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
             "hidden_act": "silu", **(raw or {})}
        self.depth, self.hidden_size = int(v["depth"]), int(v["hidden_size"])
        self.intermediate_size, self.num_heads = int(v["intermediate_size"]), int(v["num_heads"])
        self.in_channels, self.patch_size = int(v["in_channels"]), int(v["patch_size"])
        self.merge, self.temporal_patch_size = int(v["spatial_merge_size"]), int(v["temporal_patch_size"])
        self.window_size, self.out_hidden_size = int(v["window_size"]), int(v["out_hidden_size"])
        self.fullatt = {int(i) for i in v["fullatt_block_indexes"]}
        if v["hidden_act"] != "silu":
            raise ValueError(f"unsupported vision hidden_act {v['hidden_act']!r} (only 'silu')")
        rope = v.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2_5_VLRMSNorm: fp32 statistics, weight times the normalised input."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads,
                                     bias=True, params_dtype=dtype)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x [S, hidden]; attention within each segment [cu[i], cu[i+1])."""
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        c, n = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + _rotate_half(q.float()) * n).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * n).to(x.dtype)
        outs = []
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, len, D]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim ** -0.5).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(s, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], bias=True, params_dtype=dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size, dtype)
        self.norm2 = VisionRMSNorm(cfg.hidden_size, dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge ** 2
        self.ln_q = VisionRMSNorm(cfg.hidden_size, dtype)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.width, self.width, bias=True, params_dtype=dtype),
            nn.GELU(),
            RowParallelLinear(self.width, cfg.out_hidden_size, bias=True, params_dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def window_index(grid: tuple[int, int, int], cfg: QwenVisionConfig) -> tuple[np.ndarray, list[int]]:
    """(the merge units in window order, the windows' cumulative patch counts)."""
    t, h, w = grid
    m, win = cfg.merge, cfg.window_size // cfg.merge // cfg.patch_size
    gh, gw = h // m, w // m
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    ph, pw = -gh % win, -gw % win
    padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
    nh, nw = (gh + ph) // win, (gw + pw) // win
    padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
    sizes = (padded >= 0).sum(-1).reshape(-1)
    flat = padded.reshape(-1)
    cu = np.concatenate([[0], np.cumsum(sizes[sizes > 0]) * m * m]).tolist()
    return flat[flat >= 0], cu


def rotary_positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """[t*h*w, 2] (h, w) of each patch, laid out merge unit by merge unit."""
    t, h, w = grid
    hgrid, wgrid = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hpos = hgrid.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wgrid.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([hpos, wpos], axis=-1), (t, 1))


class PatchEmbed(nn.Module):
    def __init__(self, proj: nn.Conv3d) -> None:
        super().__init__()
        self.proj = proj


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        self.patch_embed = PatchEmbed(nn.Conv3d(cfg.in_channels, cfg.hidden_size, (tp, p, p), stride=(tp, p, p),
                                                bias=False, dtype=dtype))
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype)
        half = (cfg.hidden_size // cfg.num_heads) // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def forward(self, rows: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patch rows -> [t*h*w / merge^2, out_hidden]."""
        cfg, unit = self.config, self.config.merge ** 2
        conv = self.patch_embed.proj
        x = conv(rows.to(conv.weight.dtype).view(-1, cfg.in_channels, cfg.temporal_patch_size,
                                                  cfg.patch_size, cfg.patch_size)).view(rows.shape[0], -1)
        order, cu_window = window_index(grid, cfg)
        perm = torch.from_numpy(order).to(x.device)
        s = x.shape[0]
        x = x.view(s // unit, unit, -1)[perm].reshape(s, -1)
        pos = torch.from_numpy(rotary_positions(grid, cfg.merge)).to(x.device)
        freqs = (pos[..., None].float() * self.inv_freq.to(x.device)).flatten(1)  # [S, half]: h then w
        freqs = freqs.view(s // unit, unit, -1)[perm].reshape(s, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        t, h, w = grid
        cu_full = [i * h * w for i in range(t + 1)]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if i in cfg.fullatt else cu_window, cos, sin)
        return self.merger(x)[torch.argsort(perm)]
