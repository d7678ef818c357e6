"""Attention layer: paged attention through the step's backend, or a plain
causal fallback when there is no paged cache (profiling runs, model tests)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.workers.forward_context import get_forward_context


class Attention(nn.Module):
    """Heads are this rank's counts. The model runner sets `kv_cache`
    ([num_blocks, 2, block_size, num_kv_heads, head_size]) after allocation."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of "
                             f"num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.layer_index = -1  # this rank's attention layers in order (set with the cache)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, self.num_kv_heads, self.head_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None or self.kv_cache is None:
            return self._causal(q, k, v).reshape(t, -1)
        meta = ctx.attn_metadata
        conn = ctx.kv_connector  # layerwise KV connectors only (the seed's hooks)
        if conn is not None:
            conn.wait_for_layer_load(self.layer_index)
        ctx.attn_backend.write_kv(k, v, self.kv_cache, meta.slot_mapping)
        if conn is not None:
            conn.save_kv_layer(self.layer_index, self.kv_cache)
        return ctx.attn_backend.forward(q, self.kv_cache, meta, self.scale).reshape(t, -1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """All T tokens are ONE sequence at positions 0..T-1 (no cache)."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:  # GQA: query head h reads kv head h // rep
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=self.scale)
        return out.transpose(0, 1)


def find_attention_layers(model: nn.Module) -> list[Attention]:
    """This rank's Attention modules in layer order (PP-missing layers have none)."""
    return [m for m in model.modules() if isinstance(m, Attention)]
