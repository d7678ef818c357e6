"""Triton kernel storing one step's K/V into the paged cache, plus its reference.

Cache layout: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``; token
``t`` goes to slot ``s = slot_mapping[t]`` (block ``s // block_size``, offset
``s % block_size``); tokens with ``s < 0`` are padding and are not written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    num_heads,
    head_size,
    BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    # One program per token: copies its [Hkv, D] key and value tiles.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_heads) & (d < head_size)
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d * stride_cd
    out_ty = cache_ptr.dtype.element_ty
    tl.store(dst, k.to(out_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(out_ty), mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` ``[T, Hkv, D]`` (any strides) into ``kv_cache``.

    ``slot_mapping`` is ``[T]`` of any integer dtype; values are cast to the
    cache dtype. ``T == 0`` is a no-op.
    """
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert value.shape == key.shape, (key.shape, value.shape)
    assert kv_cache.shape[1] == 2 and tuple(kv_cache.shape[3:]) == (num_heads, head_size)
    assert slot_mapping.shape[0] >= num_tokens
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        num_heads,
        head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        H_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_size),
    )


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Token-by-token reference for ``write_kv`` (tests only)."""
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()[: key.shape[0]]):
        if slot < 0:
            continue
        kv_cache[slot // block_size, 0, slot % block_size] = key[t].to(kv_cache.dtype)
        kv_cache[slot // block_size, 1, slot % block_size] = value[t].to(kv_cache.dtype)
