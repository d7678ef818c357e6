"""Triton paged attention for varlen batches mixing prefill chunks and decodes.

Two paths share the cache layout ``[num_blocks, 2, block_size, Hkv, D]``:

* unified kernel: grid ``(q_tiles, Hkv)``. A tile packs ``BLOCK_Q`` query
  tokens x ``GROUP_PAD`` query heads of one KV head into ``BLOCK_M`` rows (so
  ``tl.dot`` sees >= 16 rows even for decode). The KV of the tile's request is
  walked one cache block at a time through the block table with an fp32 online
  softmax; a causal mask keeps each row at KV positions <= its own position.
  Tile -> request is found by binary search over ``query_start_loc`` inside the
  kernel, so the grid depends on tensor shapes only (no host sync; CUDA-graph
  safe).
* split-KV decode: for decode-only batches with too few (request, KV head)
  pairs to fill the GPU, each pair's context is cut into ``NUM_SEGS`` segments
  attended in parallel; a reduce kernel merges the partial softmax states.

Head sizes are padded to the next power of two with masks; fp32 inputs use
IEEE dots (no TF32), fp16/bf16 use tensor cores with fp32 accumulation.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .cache_write import write_kv
from .metadata import AttentionMetadata
from .torch_attention import paged_attention_torch

_LOG2E = 1.4426950408889634
# Split-KV heuristic knobs (see choose_num_segments).
_MIN_BLOCKS_PER_SEGMENT = 8
# KV block sizes the kernels' tiles support (conveyor.engine.config.TRITON_BLOCK_SIZES
# rejects the others at load time; a test keeps the two equal).
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
_MAX_SEGMENTS = 64


@triton.jit
def _find_request(qsl_ptr, q_tile, num_reqs, BLOCK_Q: tl.constexpr):
    # Request r owns tiles starting at qsl[r] // BLOCK_Q + r (a non-decreasing
    # sequence); return the last r whose first tile is <= q_tile.
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_block(
    q, acc, m_i, l_i, kv_base, blk, j, seq_len, q_pos, row_ok, d, d_ok,
    qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One online-softmax step over cache block `blk` (logical block j).
    offs_n = tl.arange(0, BLOCK_SIZE)
    kv_pos = j * BLOCK_SIZE + offs_n
    kv_ok = kv_pos < seq_len
    base = kv_base + blk * stride_cb
    k = tl.load(base + offs_n[None, :] * stride_cs + d[:, None] * stride_cd,
                mask=d_ok[:, None] & kv_ok[None, :], other=0.0)  # [D_PAD, BS]
    # Positions >= seq_len may hold garbage (even NaN): V must load as 0 there.
    v = tl.load(base + stride_ckv + offs_n[:, None] * stride_cs + d[None, :] * stride_cd,
                mask=kv_ok[:, None] & d_ok[None, :], other=0.0)  # [BS, D_PAD]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        visible = (kv_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
    else:
        visible = kv_ok[None, :] & row_ok[:, None]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# num_reqs stays a runtime i32 even when 1: it seeds a loop-carried variable.
@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    q_ptr, kv_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    qk_scale, num_reqs, head_size,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_bt_r, stride_bt_b,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(qsl_ptr, q_tile, num_reqs, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_begin
    q0 = (q_tile - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # cached prefix length

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP_PAD
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (q_idx < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    tok = (q_begin + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=io_mask, other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)
    q_pos = ctx + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = kv_ptr + kv_head.to(tl.int64) * stride_ch
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt_r
    # KV positions 0 .. ctx + last query of the tile.
    num_blocks = tl.cdiv(ctx + tl.minimum(q0 + BLOCK_Q, q_len), BLOCK_SIZE)
    for j in range(0, num_blocks):
        blk = tl.load(bt_row + j * stride_bt_b).to(tl.int64)
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, kv_base, blk, j, seq_len, q_pos, row_ok, d, d_ok,
            qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
            BLOCK_SIZE, True, DOT_PRECISION,
        )
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, kv_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, num_q_heads, head_size,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
    stride_bt_r, stride_bt_b,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    D_PAD: tl.constexpr, NUM_SEGS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Partial state per (request, head, segment): unnormalised acc, max m, sum l.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    tok = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - tok
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < head_size
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(kv_ptr.dtype.element_ty)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = kv_ptr + kv_head.to(tl.int64) * stride_ch
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt_r
    total = tl.cdiv(seq_len, BLOCK_SIZE)
    per_seg = tl.cdiv(total, NUM_SEGS)
    j_begin = seg * per_seg
    j_end = tl.minimum(j_begin + per_seg, total)
    for j in range(j_begin, j_end):
        blk = tl.load(bt_row + j * stride_bt_b).to(tl.int64)
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, kv_base, blk, j, seq_len, q_pos, row_ok, d, d_ok,
            qk_scale, stride_cb, stride_ckv, stride_cs, stride_cd,
            BLOCK_SIZE, False, DOT_PRECISION,
        )
    state = (req * num_q_heads + head).to(tl.int64) * NUM_SEGS + seg  # [BLOCK_M]
    tl.store(part_m_ptr + state, m_i, mask=row_ok)
    tl.store(part_l_ptr + state, l_i, mask=row_ok)
    tl.store(part_acc_ptr + state[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, qsl_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    num_q_heads, head_size, stride_ot, stride_oh, stride_od,
    D_PAD: tl.constexpr, NUM_SEGS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) - tok != 1:
        return
    segs = tl.arange(0, NUM_SEGS)
    d = tl.arange(0, D_PAD)
    state = (req * num_q_heads + head).to(tl.int64) * NUM_SEGS + segs
    m = tl.load(part_m_ptr + state)
    l = tl.load(part_l_ptr + state)
    acc = tl.load(part_acc_ptr + state[:, None] * D_PAD + d[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty segments (m = -inf) weigh 0
    den = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d < head_size)


def _dot_precision(kv_cache: torch.Tensor) -> str:
    return "ieee" if kv_cache.dtype == torch.float32 else "tf32"


def _kv_tile_bytes(kv_cache: torch.Tensor, d_pad: int) -> int:
    return d_pad * kv_cache.shape[2] * kv_cache.element_size()


def _num_warps(kv_cache: torch.Tensor, block_m: int, d_pad: int) -> int:
    # With 4 warps, ptxas (sm_90) spills or sits at 255 registers once the fp32
    # accumulator reaches 64x128 or one K/V tile reaches 16 KiB.
    return 8 if block_m * d_pad >= 8192 or _kv_tile_bytes(kv_cache, d_pad) >= 16384 else 4


def _num_stages(kv_cache: torch.Tensor, d_pad: int) -> int:
    # K + V tiles per pipeline stage must fit shared memory for D=256 / fp32.
    return 2 if _kv_tile_bytes(kv_cache, d_pad) >= 16384 else 3


def choose_num_segments(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    num_sms: int,
) -> int:
    """Split-KV segment count; 1 means "use the unified kernel".

    Split only decode-only batches (``max_query_len == 1``) whose unified grid
    (``num_reqs * num_kv_heads`` programs) is smaller than the SM count. Then
    pick the power of two ``>= 2 * num_sms / programs`` (about two waves),
    capped at 64 and so that each segment keeps >= 8 cache blocks.
    """
    programs = num_reqs * num_kv_heads
    if max_query_len != 1 or programs == 0 or programs >= num_sms:
        return 1
    want = triton.next_power_of_2(-(-2 * num_sms // programs))
    blocks = -(-max_seq_len // block_size)
    cap = 1
    while cap * 2 <= min(_MAX_SEGMENTS, blocks // _MIN_BLOCKS_PER_SEGMENT):
        cap *= 2
    segs = min(want, cap)
    return segs if segs >= 2 else 1


def _default_block_m(group_pad: int, max_query_len: int, d_pad: int) -> int:
    if max_query_len <= 1:
        return max(16, group_pad)
    return max(64 if d_pad <= 128 else 32, group_pad)


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
) -> torch.Tensor:
    """Run the unified kernel; writes rows owned by requests into ``out``."""
    num_tokens, num_q, head_size = query.shape
    num_kv = kv_cache.shape[3]
    group = num_q // num_kv
    group_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(head_size)
    block_m = block_m or _default_block_m(group_pad, max_query_len, d_pad)
    assert block_m >= 16 and block_m % group_pad == 0, (block_m, group_pad)
    block_q = block_m // group_pad
    num_reqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_reqs, num_kv)
    _unified_attention_kernel[grid](
        query, kv_cache, out, query_start_loc, seq_lens, block_table,
        scale * _LOG2E, num_reqs, head_size,
        *query.stride(), *out.stride(), *kv_cache.stride(), *block_table.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_SIZE=kv_cache.shape[2], D_PAD=d_pad, DOT_PRECISION=_dot_precision(kv_cache),
        num_warps=_num_warps(kv_cache, block_m, d_pad),
        num_stages=_num_stages(kv_cache, d_pad),
    )
    return out


def split_kv_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_segments: int,
) -> torch.Tensor:
    """Split-KV decode (every request must have query_len 1; others are skipped)."""
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0, num_segments
    _, num_q, head_size = query.shape
    num_kv = kv_cache.shape[3]
    group = num_q // num_kv
    d_pad = triton.next_power_of_2(head_size)
    num_reqs = seq_lens.shape[0]
    dev = query.device
    part_acc = torch.empty(num_reqs, num_q, num_segments, d_pad, dtype=torch.float32, device=dev)
    part_m = torch.empty(num_reqs, num_q, num_segments, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    block_m = max(16, triton.next_power_of_2(group))
    _split_kv_decode_kernel[(num_reqs, num_kv, num_segments)](
        query, kv_cache, query_start_loc, seq_lens, block_table,
        part_acc, part_m, part_l,
        scale * _LOG2E, num_q, head_size,
        *query.stride(), *kv_cache.stride(), *block_table.stride(),
        GROUP=group, BLOCK_M=block_m,
        BLOCK_SIZE=kv_cache.shape[2], D_PAD=d_pad, NUM_SEGS=num_segments,
        DOT_PRECISION=_dot_precision(kv_cache),
        num_warps=_num_warps(kv_cache, block_m, d_pad),
        num_stages=_num_stages(kv_cache, d_pad),
    )
    _split_kv_reduce_kernel[(num_reqs, num_q)](
        out, query_start_loc, part_acc, part_m, part_l,
        num_q, head_size, *out.stride(),
        D_PAD=d_pad, NUM_SEGS=num_segments, num_warps=4,
    )
    return out


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; a nominal 16 elsewhere (interpreter)."""
    if device.type != "cuda":
        return 16
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_segments: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Varlen paged attention: ``query [T, Hq, D]`` -> ``out [T, Hq, D]``.

    ``num_segments=None`` applies ``choose_num_segments``; 1 forces the unified
    kernel, > 1 (power of two) forces split-KV (decode-only batches only).
    Rows of ``out`` not owned by a request are left untouched.
    """
    _check_inputs(query, kv_cache, query_start_loc, seq_lens, block_table)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if num_segments is None:
        num_segments = choose_num_segments(
            seq_lens.shape[0], kv_cache.shape[3], max_query_len, max_seq_len,
            kv_cache.shape[2], _num_sms(query.device),
        )
    if num_segments > 1:
        assert max_query_len <= 1, "split-KV needs a decode-only batch"
        return split_kv_decode(query, kv_cache, out, query_start_loc, seq_lens, block_table,
                               scale, num_segments)
    return unified_attention(query, kv_cache, out, query_start_loc, seq_lens, block_table,
                             scale, max_query_len, block_m)


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    assert query.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[1] == 2, (
        query.shape, kv_cache.shape)
    assert kv_cache.shape[4] == query.shape[2], "head size mismatch"
    assert query.shape[1] % kv_cache.shape[3] == 0, "Hq must be a multiple of Hkv"
    assert kv_cache.shape[2] in SUPPORTED_BLOCK_SIZES, "block size must be 16, 32 or 64"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1
    assert block_table.shape[0] >= seq_lens.shape[0]


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference for ``paged_attention`` (same argument order, query dtype out)."""
    return paged_attention_torch(
        query, kv_cache, block_table,
        np.asarray(query_start_loc.cpu()), np.asarray(seq_lens.cpu()), scale,
    )


class TritonAttentionBackend:
    """Triton backend for CUDA (or the CPU interpreter in tests)."""

    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        n = meta.num_actual_tokens
        if n < out.shape[0]:
            out[n:].zero_()
        return paged_attention(
            query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, out=out,
        )
