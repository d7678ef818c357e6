"""Whole blocks (every layer) between the paged KV caches and rows of a
uint8 [n, bytes_per_block] buffer. A row holds the same bytes in every tier:
layer by layer, each layer's block ([2, block_size, kv_heads, head_size])
in its own dtype."""
from __future__ import annotations

import torch


class BlockCodec:
    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self.caches = kv_caches
        self.layer_bytes = [c[0].numel() * c.element_size() for c in kv_caches]
        self.bytes_per_block = sum(self.layer_bytes)

    def new_rows(self, n: int, pin: bool = False) -> torch.Tensor:
        return torch.empty((n, self.bytes_per_block), dtype=torch.uint8, pin_memory=pin)

    def _views(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, rows seen as [n, *block shape] in the layer's dtype."""
        out, off = [], 0
        for cache, nb in zip(self.caches, self.layer_bytes):
            out.append(rows[:, off:off + nb].view(cache.dtype).view(rows.shape[0], *cache.shape[1:]))
            off += nb
        return out

    def gather(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """rows[i] = pool block block_ids[i] (rows: a [len(block_ids), bpb] view)."""
        if not self.caches:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.caches[0].device)
        for cache, view in zip(self.caches, self._views(rows)):
            view.copy_(cache.index_select(0, idx))

    def scatter(self, rows: torch.Tensor, block_ids: list[int], non_blocking: bool = False) -> None:
        """Pool block block_ids[i] = rows[i] (non_blocking: rows are pinned and
        stay untouched until the current stream has run the copy)."""
        if not self.caches:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.caches[0].device)
        for cache, view in zip(self.caches, self._views(rows)):
            cache.index_copy_(0, idx, view.to(cache.device, non_blocking=non_blocking))
