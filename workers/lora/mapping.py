"""One step's token -> adapter-slot mapping, precomputed once per step so the
LoRA-wrapped linears (workers/lora/layers.py) only index and multiply.

Tokens with an adapter are grouped by slot (a stable sort: tokens keep their
order inside a group). Two layouts of the same grouping:
- padded (CPU): slot s's i-th token is row s * m + i of a [G * m, K] copy of
  the step's rows (one index_select; padding rows repeat token 0), so every
  slot is one batch entry of a torch.bmm. When the step has base-model
  tokens, group G - 1 = S is the wrappers' extra all-zero slot and every
  base token reads its row S * m back: the result returns to token order
  with one gather and one dense add (index_copy_/index_add_ into a zeroed
  buffer measured several times slower than the whole bmm pair);
- segments (Triton): sorted positions [seg_start[g], seg_start[g+1]) use slot
  seg_slot[g].
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAMapping:
    num_slots: int
    token_slots: np.ndarray  # [T] int, -1 = base model
    rows: torch.Tensor  # int64 [n]: tokens with an adapter, grouped by slot
    m: int  # padded rows per slot (the largest group)
    groups: int  # bmm batch: num_slots, + 1 (the zero slot) when base tokens exist
    src_index: torch.Tensor  # int64 [groups * m]: the token each padded row copies
    gather_index: torch.Tensor  # int64 [T]: each token's row in the padded output
    seg_start: torch.Tensor  # int32 [G + 1]
    seg_slot: torch.Tensor  # int32 [G]
    positions: torch.Tensor  # int64 [n]: 0..n-1 (the Triton expand's input rows)

    @classmethod
    def build(cls, token_slots: np.ndarray, num_slots: int, device: torch.device) -> LoRAMapping | None:
        """None when no token uses an adapter (the step runs the base model only)."""
        sel = np.flatnonzero(token_slots >= 0)
        if sel.size == 0:
            return None
        order = sel[np.argsort(token_slots[sel], kind="stable")]
        slots = token_slots[order].astype(np.int64)
        counts = np.bincount(slots, minlength=num_slots)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        within = np.arange(order.size) - starts[slots]
        m = int(counts.max())
        groups = num_slots + (1 if order.size < token_slots.size else 0)
        pad = slots * m + within
        src = np.zeros(groups * m, dtype=np.int64)
        src[pad] = order
        gather = np.full(token_slots.size, num_slots * m, dtype=np.int64)  # the zero slot
        gather[order] = pad
        used = np.flatnonzero(counts)
        seg_start = np.concatenate((starts[used], [order.size])).astype(np.int32)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return cls(num_slots, token_slots, dev(order.astype(np.int64)), m, groups, dev(src), dev(gather),
                   dev(seg_start), dev(used.astype(np.int32)), dev(np.arange(order.size, dtype=np.int64)))


_MAPPING: LoRAMapping | None = None


def get_lora_mapping() -> LoRAMapping | None:
    return _MAPPING


@contextlib.contextmanager
def set_lora_mapping(mapping: LoRAMapping | None) -> Iterator[None]:
    global _MAPPING
    prev, _MAPPING = _MAPPING, mapping
    try:
        yield
    finally:
        _MAPPING = prev


def add_lora(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
             mp: LoRAMapping) -> None:
    """y[t] += x[t] @ a_t[s] @ b_t[s] for every token t with slot s, in place.
    a_t: [S + 1, K, R], b_t: [S + 1, R, N] (scale folded into b_t; slot S all zero)."""
    if x.is_cuda:
        _add_lora_triton(x, y, a_t, b_t, mp)
        return
    g, m = mp.groups, mp.m
    xp = x.index_select(0, mp.src_index).view(g, m, x.shape[-1])
    out = torch.bmm(torch.bmm(xp, a_t[:g]), b_t[:g])
    y.add_(out.view(g * m, -1).index_select(0, mp.gather_index))


def _add_lora_triton(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                     mp: LoRAMapping) -> None:
    from kernels.lora_triton import segmented_mm

    x = x.contiguous()
    shrunk = torch.empty(mp.rows.numel(), a_t.shape[2], dtype=torch.float32, device=x.device)
    segmented_mm(x, a_t, shrunk, mp.rows, mp.positions, mp.seg_start, mp.seg_slot, mp.m, add=False)
    segmented_mm(shrunk, b_t, y, mp.positions, mp.rows, mp.seg_start, mp.seg_slot, mp.m, add=True)
