"""One step's token -> adapter-slot mapping, precomputed once per step so the
LoRA-wrapped linears (conveyor/workers/lora/layers.py) only index and multiply.

Tokens with an adapter are grouped by slot (a stable sort: tokens keep their
order inside a group). On CPU in fp32 with the kernel extension loaded, the
fused op (conveyor/kernels/lora_cpu.py) takes `rows` and `segs` and needs nothing
else; the torch paths (torch backend, other dtypes) use these layouts of
the same grouping:
- padded (CPU, groups of similar size, e.g. decode): slot s's i-th token is
  row s * m + i of a [G * m, K] copy of the step's rows (one index_select;
  padding rows repeat token 0), so every slot is one batch entry of a
  torch.bmm. When the step has base-model tokens, group G - 1 = S is the
  wrappers' extra all-zero slot and every base token reads its row S * m
  back: the result returns to token order with one gather and one dense add
  (index_copy_/index_add_ into a zeroed buffer measured several times slower
  than the whole bmm pair);
- sorted (CPU, uneven groups, e.g. prefill, where padding to the largest
  group would multiply the work): the grouped rows, one torch.mm pair per
  used slot on contiguous slices (`segments`), back to token order through
  `seg_gather` (base tokens read an extra zero row n);
- runs (CPU, long same-adapter runs in token order, e.g. prefill chunks):
  no copies at all: per run one mm on x's own rows and one in-place addmm_
  per sub-projection into y's rows (the expand's [rows, N] product, its
  gather and its add were the bulk of a prefill step's LoRA time: memory
  traffic on a product with inner dimension R);
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
    padded: bool  # CPU: the bmm over padded groups (else the sorted mm per segment)
    segments: list[tuple[int, int, int]]  # (start, end, slot) of each used slot's sorted rows
    seg_gather: torch.Tensor  # int64 [T]: each token's sorted row, n for base tokens
    runs: list[tuple[int, int, int]] | None  # CPU: (start, end, slot) in token order, when long
    segs: torch.Tensor  # int64 [G, 3]: `segments` as a tensor (the fused CPU op's input)
    cpu_isa: str | None  # CPU: the fused op's kernel table (conveyor/kernels/lora_cpu.py); None: torch paths

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
        segments = [(int(seg_start[i]), int(seg_start[i + 1]), int(s)) for i, s in enumerate(used)]
        seg_gather = np.full(token_slots.size, order.size, dtype=np.int64)
        seg_gather[order] = np.arange(order.size)
        # Padding costs (groups * m - n) wasted rows; a python-level mm pair per
        # slot costs more than a few wasted rows each, so pad unless it wastes a lot.
        padded = groups * m <= PAD_WASTE * token_slots.size + PAD_SLACK * groups

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        runs = _runs(token_slots)
        segs = np.array(segments, dtype=np.int64).reshape(-1, 3)
        return cls(num_slots, token_slots, dev(order.astype(np.int64)), m, groups, dev(src), dev(gather),
                   dev(seg_start), dev(used.astype(np.int32)), dev(np.arange(order.size, dtype=np.int64)),
                   bool(padded), segments, dev(seg_gather),
                   runs if token_slots.size >= RUN_MIN_LEN * max(len(runs), 1) else None,
                   dev(segs), _cpu_isa(device))


RUN_MIN_LEN = 16  # mean tokens per adapter run for the runs path (decode's runs are 1 token)
PAD_WASTE = 3.0  # padded rows allowed per token of the step (1.7x still measured faster padded) ...
PAD_SLACK = 8  # ... plus this many per group (decode's small, even groups always pad)
_MAPPING: LoRAMapping | None = None


def _runs(token_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of one adapter slot in token order (base-model runs left out)."""
    edges = np.flatnonzero(np.diff(token_slots)) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [token_slots.size]))
    return [(int(a), int(b), int(token_slots[a])) for a, b in zip(starts, ends) if token_slots[a] >= 0]


def _cpu_isa(device: torch.device) -> str | None:
    if device.type != "cpu":
        return None
    from conveyor.kernels.lora_cpu import kernel_isa

    return kernel_isa()


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


# A fused layer's sub-projection on CPU: (its columns of the shrunk rows, its
# output columns, its own B^T * scale [S + 1, R_i, N_i]).
SubBlock = tuple[slice, slice, torch.Tensor]


def add_lora(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor | None,
             mp: LoRAMapping, subs: list[SubBlock] | None = None) -> None:
    """y[t] += x[t] @ a_t[s] @ b_t[s] for every token t with slot s, in place.
    a_t: [S + 1, K, R], b_t: [S + 1, R, N] (scale folded into b_t; slot S all zero).
    With `subs` (CPU) b_t is unused: sub-projection i adds
    (x @ a_t[s])[:, rank_i] @ B_i[s] to y[:, out_i]."""
    if x.is_cuda:
        assert b_t is not None, "the Triton path expands through the block-diagonal b_t"
        _add_lora_triton(x, y, a_t, b_t, mp)
        return
    if mp.cpu_isa is not None and x.dtype == y.dtype == a_t.dtype == torch.float32 and x.dim() == 2:
        from conveyor.kernels.lora_cpu import lora_add

        blocks = lora_blocks(b_t, subs)
        lora_add(x, y, a_t, [b for _, _, b in blocks], [o.start or 0 for _, o, _ in blocks], mp.rows, mp.segs,
                 mp.cpu_isa)
        return
    if mp.runs is not None:
        for start, end, slot in mp.runs:
            shrunk = torch.mm(x[start:end], a_t[slot])
            for r, o, b in lora_blocks(b_t, subs):
                y[start:end, o].addmm_(shrunk[:, r], b[slot])
        return
    if not mp.padded:
        _add_lora_sorted(x, y, a_t, b_t, mp, subs)
        return
    g, m = mp.groups, mp.m
    xp = x.index_select(0, mp.src_index).view(g, m, x.shape[-1])
    shrunk = torch.bmm(xp, a_t[:g])
    for r, o, b in lora_blocks(b_t, subs):
        out = torch.bmm(shrunk[:, :, r], b[:g])
        y[:, o].add_(out.view(g * m, -1).index_select(0, mp.gather_index))


def lora_blocks(b_t: torch.Tensor | None, subs: list[SubBlock] | None) -> list[SubBlock]:
    """(rank columns, output columns, B) per expand: the layer holds either
    per-sub-projection Bs (CPU) or one block-diagonal b_t."""
    if subs is not None:
        return subs
    assert b_t is not None, "a LoRA layer holds subs or b_t"
    return [(slice(None), slice(None), b_t)]


def _add_lora_sorted(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor | None,
                     mp: LoRAMapping, subs: list[SubBlock] | None) -> None:
    n = mp.rows.numel()
    xs = x.index_select(0, mp.rows)
    shrunk = y.new_empty(n, a_t.shape[-1])
    for start, end, slot in mp.segments:
        torch.mm(xs[start:end], a_t[slot], out=shrunk[start:end])
    for r, o, b in lora_blocks(b_t, subs):
        out = y.new_empty(n + 1, b.shape[-1])
        out[n].zero_()  # base-model tokens read this row
        for start, end, slot in mp.segments:
            torch.mm(shrunk[start:end, r], b[slot], out=out[start:end])
        y[:, o].add_(out.index_select(0, mp.seg_gather))


def _add_lora_triton(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                     mp: LoRAMapping) -> None:
    from conveyor.kernels.lora_triton import segmented_mm

    x = x.contiguous()
    shrunk = torch.empty(mp.rows.numel(), a_t.shape[2], dtype=torch.float32, device=x.device)
    segmented_mm(x, a_t, shrunk, mp.rows, mp.positions, mp.seg_start, mp.seg_slot, mp.m, add=False)
    segmented_mm(shrunk, b_t, y, mp.positions, mp.rows, mp.seg_start, mp.seg_slot, mp.m, add=True)
