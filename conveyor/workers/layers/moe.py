"""The mixture-of-experts layer: route, group the tokens by expert, run only
the experts that got tokens, scatter back weighted by the router.

Experts are stored stacked: `w13_weight` [E_local, 2 * I_part, H] (gate rows
then up rows) and `w2_weight` [E_local, H, I_part]. The checkpoint holds one
tensor per expert; the loader stacks them (`weight_loader(param, w, (expert,
part))`, conveyor/workers/model_loader.py maps the names).

Two layouts over the TP ranks (every rank holds every token: attention is
tensor-parallel, so the hidden states are replicated after its all-reduce):
- sharded (default): every rank holds every expert, its 1/tp slice of the
  intermediate dimension (as a dense MLP's gate_up/down);
- expert parallel (`parallel.enable_expert_parallel`): rank r holds experts
  [r * E / tp, (r + 1) * E / tp) whole and computes only their share.
Either way a rank returns a partial sum over [T, H]; the caller all-reduces
it once (the collective stays visible in the model's forward). With every
token already on every rank, "all-gather tokens, local experts, reduce-scatter"
is exactly that one all-reduce, so gloo and NCCL take the same path.

Invariants: per token the experts' outputs are summed in ascending expert
order (as transformers' reference loop does); no token goes through an expert
the router did not pick; there is no per-token Python loop (one per expert
with tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu_linear, cpu_moe
from conveyor.parallel import state
from conveyor.parallel.layers import (
    _ONEDNN,
    WeightLike,
    _copy_checked,
    _packed_copy,
    _small_isa,
    default_weight_loader,
    divide,
    host_empty,
    linear,
    make_param,
    narrow_load,
    onednn_rows,
)
from conveyor.workers.layers.activation import SiluAndMul


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the experts in fp32, then top-k (the families' shared rule);
    renormalize: the k weights divided by their sum. Returns (fp32 weights
    [T, k], expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class _ExpertSlot(nn.Module):
    """Holds one expert matrix's packed copies (conveyor/parallel/layers.py linear)."""


class FusedMoE(nn.Module):
    def __init__(self, shape: MoEShape, dtype: torch.dtype, expert_parallel: bool = False) -> None:
        super().__init__()
        self.shape = shape
        tp, rank = state.tp_size(), state.tp_rank()
        self.expert_parallel = expert_parallel and tp > 1
        if self.expert_parallel:
            if shape.num_experts % tp:
                raise ValueError(f"expert parallelism: num_experts {shape.num_experts} is not a multiple of "
                                 f"tensor_parallel_size {tp}; choose a size that divides it, or turn "
                                 "parallel.enable_expert_parallel off (experts TP-sharded)")
            self.num_local = shape.num_experts // tp
            self.first_expert = rank * self.num_local
            self.i_part = shape.intermediate_size
        else:
            self.num_local, self.first_expert = shape.num_experts, 0
            self.i_part = divide(shape.intermediate_size, tp, "moe intermediate_size / tp_size")
        self.tp_rank = 0 if self.expert_parallel else rank
        h, i, e = shape.hidden_size, self.i_part, self.num_local
        self.w13_weight = nn.Parameter(host_empty((e, 2 * i, h), dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(host_empty((e, h, i), dtype), requires_grad=False)
        wanted = {(x, p) for x in range(self.first_expert, self.first_expert + e) for p in (0, 1)}
        for p, parts in ((self.w13_weight, wanted), (self.w2_weight, {(x, None) for x, _ in wanted})):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            # What the loader must have seen (missing experts fail at startup, named).
            p.expected_shards = parts  # type: ignore[attr-defined]
        # Not submodules: holders of each expert matrix's packed copies.
        self._slots = [(_ExpertSlot(), _ExpertSlot()) for _ in range(e)]
        self.act = SiluAndMul()
        # Tokens routed to each expert (all experts, whichever rank holds them)
        # since take_routed_tokens last read them: the routing metric.
        self.routed = torch.zeros(shape.num_experts, dtype=torch.int64)

    def weight_loader(self, param: torch.Tensor, loaded: WeightLike, shard: tuple[int, int | None]) -> None:
        """One expert's checkpoint tensor: part 0 gate [I, H], 1 up [I, H],
        None down [H, I]; experts of other ranks (expert parallel) are skipped."""
        expert, part = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            if 0 <= expert < self.shape.num_experts:
                return
            raise ValueError(f"expert {expert} is outside num_experts {self.shape.num_experts}")
        i = self.i_part
        if part is None:
            _copy_checked(param.data[local], narrow_load(loaded, 1, self.tp_rank * i, i), f"expert {expert} down")
        else:
            rows = param.data[local].narrow(0, part * i, i)
            _copy_checked(rows, narrow_load(loaded, 0, self.tp_rank * i, i), f"expert {expert} gate/up")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's fp32 weights and ids [T, k] -> this rank's
        partial output [T, H] in x's dtype (to be all-reduced over TP)."""
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.shape.num_experts)
        self.routed += counts  # read at sampling time, not here (no device sync per layer)
        if x.is_cuda:  # grouped GEMMs in Triton (conveyor/kernels/fused_moe.py)
            from conveyor.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.first_expert)
        isa = self._grouped_isa(x)
        if isa is not None:
            w13 = _packed_copy(self, "_grouped13", self.w13_weight, cpu_moe.pack_experts)
            w2 = _packed_copy(self, "_grouped2", self.w2_weight, cpu_moe.pack_experts)
            return cpu_moe.experts(x, w13, w2, self.i_part, (topk_weights.float(), topk_ids),
                                   self.first_expert, isa)
        return self._per_expert(x, topk_weights, topk_ids, counts)

    def _grouped_isa(self, x: torch.Tensor) -> str | None:
        """The grouped op's kernel for this call (conveyor/kernels/cpu_moe.py),
        else None (the per-expert loop)."""
        if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in cpu_linear.DTYPES \
                or self.w13_weight.dtype != x.dtype:
            return None
        isa = cpu_linear.kernel_isa()
        if isa is None:
            return None
        return cpu_moe.kernel_for(isa, x.dtype, x.shape[0] * self.shape.top_k, self.shape.num_experts)

    def _per_expert(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        weights = topk_weights.reshape(-1)[order]
        per_expert = counts.tolist()
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        start = sum(per_expert[:self.first_expert])
        for local in range(self.num_local):
            n = per_expert[self.first_expert + local]
            if n:
                rows = tokens[start:start + n]
                y = self._expert(local, x.index_select(0, _gather_rows(rows, x.dtype)))[:n].float()
                out.index_add_(0, rows, y.mul_(weights[start:start + n, None]))
            start += n
        return out.to(x.dtype)

    def _expert(self, local: int, xe: torch.Tensor) -> torch.Tensor:
        isa = _small_isa(self, xe, self.w13_weight)
        if isa is not None:
            # Decode-sized rows: the small-M kernel over this expert's slice of
            # the grouped op's packed stack (the same packing, the same bits), not
            # a per-expert packed copy beside it (up to one more copy of every expert).
            w13 = _packed_copy(self, "_grouped13", self.w13_weight, cpu_moe.pack_experts)
            w2 = _packed_copy(self, "_grouped2", self.w2_weight, cpu_moe.pack_experts)
            h = cpu_linear.small_linear(xe, w13[local], 2 * self.i_part, None, isa)
            return cpu_linear.small_linear(self.act(h.contiguous()), w2[local], self.shape.hidden_size, None, isa)
        s13, s2 = self._slots[local]
        h = linear(s13, xe, self.w13_weight[local])
        return linear(s2, self.act(h.contiguous()), self.w2_weight[local])



def _gather_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows an expert gathers: fp32 calls above 64 rows go to oneDNN,
    which runs onednn_rows(n) rows; the gather repeats the first token up to
    that count, so neither linear pads its input (F.pad's fill and copy were
    ~5% of a 4096-row layer). The extra rows' outputs are dropped."""
    n = rows.numel()
    bucket = onednn_rows(n)
    if dtype != torch.float32 or not _ONEDNN or bucket == n:
        return rows
    return torch.cat([rows, rows[:1].expand(bucket - n)])


def dense_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, the unpicked weighted by 0: the
    reference the fused layer is tested and measured against (never served)."""
    e = w13.shape[0]
    dense = torch.zeros(x.shape[0], e, dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights.float())
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    i = w13.shape[1] // 2
    for j in range(e):
        h = F.linear(x, w13[j])
        y = F.linear(F.silu(h[:, :i]) * h[:, i:], w2[j])
        out += y.float() * dense[:, j:j + 1]
    return out.to(x.dtype)


def moe_shape(config: Any, num_experts: int, intermediate_size: int) -> MoEShape:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for the experts (only 'silu')")
    return MoEShape(num_experts, int(config.num_experts_per_tok), int(config.hidden_size), intermediate_size)


class RouterGate(nn.Module):
    """The router's linear (hidden -> experts, no bias), replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = make_param((num_experts, hidden_size), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def take_routed_tokens(layers: list[FusedMoE]) -> list[int] | None:
    """Tokens routed to each expert, summed over `layers`, since the last
    call (None without MoE layers); the counts start over."""
    if not layers:
        return None
    total = torch.zeros(layers[0].shape.num_experts, dtype=torch.int64)
    for layer in layers:
        total += layer.routed.cpu()
        layer.routed = torch.zeros_like(layer.routed)
    return [int(n) for n in total.tolist()]
