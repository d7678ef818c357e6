"""LoRA-wrapped TP linears. Only built when lora.enable: without LoRA the
model keeps its plain layers and pays nothing.

Each wrapper holds max_loras slots of stacked weights, sub-projections of a
fused linear side by side:
    a_t [S, in_per_rank, n_sub * R]    (A^T of each sub-projection, rank-padded)
so one shrink serves q, k and v (or gate and up) together. B^T * scale:
- CUDA: b_t [S, n_sub * R, out_per_rank], block diagonal over sub-projections,
  so one Triton expand serves all of them;
- CPU, fused layers: one compact [S, R, out_i] per sub-projection (`subs`),
  expanded block by block: at decode the expand streams its weights for a
  few rows per slot, and the block-diagonal zeros were half (gate/up) to two
  thirds (q/k/v) of those bytes.
Zero-padded ranks and absent sub-projections contribute exactly zero.

TP: a column-parallel layer keeps A whole and this rank's rows of B (its
output features); a row-parallel layer keeps this rank's columns of A (its
input features) and B whole, and adds its partial delta before the
all-reduce, like its partial base product.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.parallel import state
from conveyor.parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
)
from conveyor.workers.lora.mapping import SubBlock, add_lora, get_lora_mapping, lora_blocks


class _LoRALinearBase(nn.Module):
    a_t: torch.Tensor  # buffers, see the module docstring
    b_t: torch.Tensor | None

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, in_size: int, out_sizes: list[int], num_slots: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.max_rank = max_rank
        self.out_sizes = out_sizes  # per-rank output features of each sub-projection
        self.out_offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        w = base.weight
        n_sub = len(out_sizes)
        split = n_sub > 1 and w.device.type == "cpu"

        def zeros(*shape: int) -> torch.Tensor:
            # One extra slot, always zero: base-model tokens read it (conveyor/workers/lora/mapping.py).
            return torch.zeros(num_slots + 1, *shape, dtype=w.dtype, device=w.device)

        self.register_buffer("a_t", zeros(in_size, n_sub * max_rank), persistent=False)
        self.b_t = None if split else zeros(n_sub * max_rank, sum(out_sizes))
        self.subs: list[SubBlock] | None = None
        if split:
            self.subs = [(slice(i * max_rank, (i + 1) * max_rank), slice(off, off + size), zeros(max_rank, size))
                         for i, (off, size) in enumerate(zip(self.out_offsets, out_sizes))]

    def clear_slot(self, slot: int) -> None:
        self.a_t[slot].zero_()
        for _, _, b in lora_blocks(self.b_t, self.subs):
            b[slot].zero_()

    def set_sub(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: [r, in_per_rank] (lora_A, this rank's part), b: [out_per_rank, r]
        (lora_B's rows for this rank, scale applied)."""
        r, lo = a.shape[0], sub * self.max_rank
        off, size = self.out_offsets[sub], self.out_sizes[sub]
        self.a_t[slot, :, lo:lo + r].copy_(a.t())
        if self.subs is not None:
            self.subs[sub][2][slot, :r].copy_(b.t())
        else:
            assert self.b_t is not None, "a LoRA layer holds subs or b_t"
            self.b_t[slot, lo:lo + r, off:off + size].copy_(b.t())

    def _delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mp = get_lora_mapping()
        if mp is not None:
            add_lora(x, y, self.a_t, self.b_t, mp, self.subs)
        return y


class ColumnParallelLinearWithLoRA(_LoRALinearBase):
    base: ColumnParallelLinear

    def __init__(self, base: ColumnParallelLinear, num_slots: int, max_rank: int) -> None:
        if isinstance(base, QKVParallelLinear):
            q, kv = base.num_heads * base.head_size, base.num_kv_heads * base.head_size
            outs = [q, kv, kv]
        elif isinstance(base, MergedColumnParallelLinear):
            outs = [o // base.tp_size for o in base.output_sizes]
        else:
            outs = [base.output_size_per_partition]
        super().__init__(base, base.input_size, outs, num_slots, max_rank)

    def b_rows(self, sub: int) -> tuple[int, int]:
        """(start, size) of this rank's rows in the sub-projection's full lora_B."""
        base = self.base
        size = self.out_sizes[sub]
        if isinstance(base, QKVParallelLinear) and sub > 0:
            return (base.tp_rank // base.num_kv_head_replicas) * size, size
        return base.tp_rank * size, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = self._delta(x, linear(base, x, base.weight, base.bias))
        return state.tp_all_gather(y, dim=-1) if base.gather_output else y


class RowParallelLinearWithLoRA(_LoRALinearBase):
    base: RowParallelLinear

    def __init__(self, base: RowParallelLinear, num_slots: int, max_rank: int) -> None:
        super().__init__(base, base.input_size_per_partition, [base.output_size], num_slots, max_rank)

    def a_cols(self) -> tuple[int, int]:
        size = self.base.input_size_per_partition
        return self.base.tp_rank * size, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not base.input_is_parallel:
            size = base.input_size_per_partition
            x = x.narrow(-1, base.tp_rank * size, size)
        y = self._delta(x, linear(base, x, base.weight))
        if base.reduce_results:
            y = state.tp_all_reduce(y)  # base and LoRA partial sums together
        if base.bias is not None:
            y = y + base.bias
        return y


LoRALinear = ColumnParallelLinearWithLoRA | RowParallelLinearWithLoRA
