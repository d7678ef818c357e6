"""Segmented (grouped-by-adapter) LoRA matmuls in Triton: Punica-style shrink
and expand as one kernel, plus the per-row torch reference beside it.

Rows of a step are sorted by adapter slot (conveyor/workers/lora/mapping.py); segment g
covers sorted positions [seg_start[g], seg_start[g+1]) and uses slot
seg_slot[g]. For each of its rows j:

    out[out_rows[j]] (+)= x[in_rows[j]] @ W[seg_slot[g]]        W: [S, K, N]

Shrink: x = the layer input, in_rows = the token of each sorted position,
out_rows = the sorted position (a [n, R] buffer), W = A^T. Expand: x = that
buffer, in_rows = sorted positions, out_rows = tokens, W = B^T * scale, added.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segmented_mm_kernel(x_ptr, w_ptr, out_ptr, in_rows_ptr, out_rows_ptr, seg_start_ptr,
                         seg_slot_ptr, K, N, stride_xm, stride_ws, stride_wk, stride_wn, stride_om,
                         ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    # Program (segment g, row tile m, column tile n).
    g = tl.program_id(0)
    start = tl.load(seg_start_ptr + g)
    end = tl.load(seg_start_ptr + g + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 >= end:
        return
    slot = tl.load(seg_slot_ptr + g).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    xr = tl.load(in_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    orow = tl.load(out_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + xr[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + slot * stride_ws + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    dst = out_ptr + orow[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD:
        acc += tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segmented_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, in_rows: torch.Tensor,
                 out_rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                 max_seg_len: int, add: bool) -> None:
    """out[out_rows[j]] (+)= x[in_rows[j]] @ w[slot of j's segment]; x, out
    row-major with unit column stride; index tensors int32/int64."""
    assert x.stride(-1) == 1 and out.stride(-1) == 1
    k, n = w.shape[1], w.shape[2]
    num_segs = seg_slot.numel()
    if num_segs == 0:
        return
    block_m, block_n, block_k = 16, 32, 32
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _segmented_mm_kernel[grid](x, w, out, in_rows, out_rows, seg_start, seg_slot, k, n,
                               x.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                               ADD=add, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def lora_reference(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                   token_slots: list[int]) -> torch.Tensor:
    """Row by row: y[i] + x[i] @ a_t[s] @ b_t[s] for rows with slot s >= 0
    (a_t: [S, K, R], b_t: [S, R, N], the scale already in b_t)."""
    out = y.clone()
    for i, s in enumerate(token_slots):
        if s >= 0:
            out[i] += (x[i:i + 1].float() @ a_t[s].float() @ b_t[s].float())[0].to(y.dtype)
    return out
