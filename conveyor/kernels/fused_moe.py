"""Triton fused mixture-of-experts for GPU: grouped GEMMs over the
(token, expert) pairs sorted by expert.

`align_pairs` sorts the T * k pairs by expert and pads each expert's run to a
multiple of BLOCK_M, so every row block of the grouped GEMM belongs to one
expert (`block_expert`); padding rows point past the pairs and are masked.
Two launches of one kernel then compute, per block of pairs:
1. h = x[token(pair)] @ w13[e].T           -> [T * k, 2I] (gate | up),
2. y = act(h)[pair] @ w2[e].T * weight     -> [T * k, H],
and the k rows of each token are summed. Only the experts that got tokens run,
each over its own rows. The reference is conveyor/workers/layers/moe.py
`dense_reference`; tests run this kernel under TRITON_INTERPRET=1 (fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert to block_m with T*k, the expert of
    each row block). Pair p is token p // k, slot p % k."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    sorted_ids = torch.full((int(padded.sum().item()),), n, dtype=torch.int64, device=flat.device)
    expert_of = flat[order]  # each sorted pair's expert
    run_start = torch.cumsum(counts, 0) - counts
    rank_in_run = torch.arange(n, device=flat.device) - run_start[expert_of]
    sorted_ids[starts[expert_of] + rank_in_run] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr,
    num_pairs, n, k, a_row_div,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program (row block, column block): C[pair, cols] = A[pair // a_row_div] @ B[e, cols].T.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs // a_row_div, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + pairs, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    out_rows = tl.where(row_ok, pairs, 0)
    tl.store(c_ptr + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor],
                  num_pairs: int, a_row_div: int, weights: torch.Tensor | None) -> torch.Tensor:
    sorted_ids, block_expert = pairs
    n, k = w.shape[1], w.shape[2]
    c = torch.zeros(num_pairs, n, dtype=a.dtype if weights is None else torch.float32, device=a.device)
    block_n, block_k = 32, 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, weights if weights is not None else c, sorted_ids, block_expert,
        num_pairs, n, k, a_row_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        MUL_WEIGHT=weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (experts first_expert ..
    first_expert + E - 1: a rank's share under expert parallelism), the
    router's weights and ids [T, k] -> this rank's [T, H] in x's dtype. Pairs
    of other ranks' experts are sorted last and never run (their rows stay 0)."""
    t, top_k = topk_ids.shape
    num_pairs, e = t * top_k, w13.shape[0]
    local = topk_ids - first_expert
    local = torch.where((local >= 0) & (local < e), local, e)  # e: another rank's expert
    sorted_ids, block_expert = align_pairs(local, e + 1)
    keep = block_expert < e
    pairs = (sorted_ids.view(-1, BLOCK_M)[keep].reshape(-1), block_expert[keep].contiguous())
    h = _grouped_gemm(x, w13, pairs, num_pairs, top_k, None)
    i = w13.shape[1] // 2
    act = (F.silu(h[:, :i].float()) * h[:, i:].float()).to(x.dtype)
    y = _grouped_gemm(act, w2, pairs, num_pairs, 1, topk_weights.reshape(-1).float().contiguous())
    return y.view(t, top_k, -1).sum(dim=1).to(x.dtype)
