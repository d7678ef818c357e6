"""Pure-torch paged attention: the reference backend and the CPU default.

All math runs in fp32 and is cast back to the query dtype. Decode rows
(query_len == 1) are batched: their K/V are gathered through the block table
into a padded ``[B, max_seq, Hkv, D]`` tensor and attended with one masked
softmax. Short queries (query_len <= _SHORT_QUERY: speculative drafts plus
their bonus position) run the same way, one K/V gather per request with its
query tokens side by side, each seeing keys up to its own position. Longer prefill chunks run one request at a time:
on CPU as two flash-attention calls (the cached prefix unmasked, the chunk's
own keys causal) merged by their log-sum-exps; elsewhere through
``scaled_dot_product_attention`` with a causal mask offset by the prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata

# Upper bound on gathered K+V elements per decode chunk (fp32: 4 bytes each), and
# rows per chunk: small chunks keep the gathered K/V in cache.
_DECODE_GATHER_BUDGET = 1 << 24
_DECODE_CHUNK_ROWS = 16
# Longest query slice attended in one SDPA call (bounds the mask / score memory).
_PREFILL_CHUNK = 1024
# Queries up to this long (1 + the most speculative tokens) run as decode rows.
_SHORT_QUERY = 9
# CPU flash attention that also returns each row's log-sum-exp (GQA inside).
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def write_kv_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kv_cache[s // bs, 0|1, s % bs] = key|value[t]`` for every ``s = slot_mapping[t] >= 0``."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[valid].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[valid].to(kv_cache.dtype)


def _gather_kv(
    kv_cache: torch.Tensor, blocks: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for positions ``0..length-1`` of the blocks ``[..., nblk]``, in fp32.

    Returns tensors ``[..., length, Hkv, D]``.
    """
    kv = kv_cache[blocks]  # [..., nblk, 2, bs, Hkv, D]
    lead = blocks.shape[:-1]
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    k = kv.select(-4, 0).reshape(*lead, -1, heads, dim)[..., :length, :, :]
    v = kv.select(-4, 1).reshape(*lead, -1, heads, dim)[..., :length, :, :]
    return k.float(), v.float()


@dataclass(frozen=True)
class _Paged:
    """One paged_attention_torch call: what every decode / short-query chunk reads and writes."""
    query: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [num_blocks, 2, bs, Hkv, D]
    block_table: torch.Tensor
    scale: float
    out: torch.Tensor  # [T, Hq, D]


def _gather_rows(p: _Paged, reqs: np.ndarray, lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of requests ``reqs`` (lengths ``lens``), head-major ``[Hkv, B, S, D]``
    fp32 (S: the longest, in whole blocks), V zero past each length.

    One ``index_select`` each on the cache viewed as rows of ``D``, so the
    products after are plain batched GEMMs over (Hkv, B) and nothing else is copied."""
    dev = p.query.device
    num_blocks, _, bs, hkv, d = p.kv_cache.shape
    b, s = len(reqs), _cdiv(int(lens.max()), bs) * bs
    blocks = p.block_table[torch.from_numpy(reqs).to(dev), : s // bs].long().clamp_(0, num_blocks - 1)
    pos = torch.arange(s, device=dev)
    slot = blocks[:, pos // bs] * (2 * bs) + pos % bs  # [B, S]: row of (block, K, offset) in units of Hkv
    rows = (slot[None] * hkv + torch.arange(hkv, device=dev)[:, None, None]).view(-1)
    flat = p.kv_cache.view(-1, d)
    k = flat.index_select(0, rows).view(hkv, b, s, d).float()
    v = flat.index_select(0, rows + bs * hkv).view(hkv, b, s, d).float()
    # Padded positions may hold garbage (even NaN): zero V there (the caller -infs the scores).
    v.masked_fill_(torch.from_numpy(np.arange(s)[None, :] >= lens[:, None]).to(dev)[None, :, :, None], 0.0)
    return k, v


def _by_length(p: _Paged, lens: np.ndarray) -> list[np.ndarray]:
    """Request positions sorted by length, in small chunks: little padding, and
    each chunk's gathered K/V stays cache-sized (memory bandwidth bounds this path)."""
    per_row = (int(lens.max()) + p.kv_cache.shape[2]) * p.kv_cache.shape[3] * p.kv_cache.shape[4] * 2
    chunk = max(1, min(_DECODE_CHUNK_ROWS, _DECODE_GATHER_BUDGET // per_row))
    order = np.argsort(lens, kind="stable")
    return [order[i:i + chunk] for i in range(0, len(order), chunk)]


def _decode_rows(p: _Paged, tokens: np.ndarray, reqs: np.ndarray, lens: np.ndarray) -> None:
    """Attention for single-token queries ``tokens`` of requests ``reqs`` (lengths ``lens``)."""
    dev = p.query.device
    hkv, d = p.kv_cache.shape[3], p.kv_cache.shape[4]
    hq, b = p.query.shape[1], len(reqs)
    k, v = _gather_rows(p, reqs, lens)
    pad = torch.from_numpy(np.arange(k.shape[2])[None, :] >= lens[:, None]).to(dev)  # [B, S]
    tok = torch.from_numpy(tokens).to(dev)
    q = p.query[tok].float().view(b, hkv, hq // hkv, d).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(q, k.transpose(2, 3))  # [Hkv, B, G, S]
    scores.mul_(p.scale).masked_fill_(pad[None, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, B, G, D]
    p.out[tok] = o.transpose(0, 1).reshape(b, hq, d).to(p.out.dtype)


def _short_rows(p: _Paged, starts: np.ndarray, reqs: np.ndarray, q_lens: np.ndarray,
                lens: np.ndarray) -> None:
    """Attention for short queries (speculative drafts + the bonus position):
    one K/V gather per request, its query tokens side by side, each token
    seeing keys up to its own position (seq_len - q_len + i)."""
    dev = p.query.device
    hkv, d = p.kv_cache.shape[3], p.kv_cache.shape[4]
    hq, b, qm = p.query.shape[1], len(reqs), int(q_lens.max())
    g = hq // hkv
    k, v = _gather_rows(p, reqs, lens)
    s = k.shape[2]
    within = np.arange(qm)[None, :]
    tok = starts[:, None] + np.minimum(within, q_lens[:, None] - 1)  # [B, Qm]; padding repeats the last
    last_key = np.minimum(lens[:, None] - q_lens[:, None] + within, lens[:, None] - 1)
    hidden = np.arange(s)[None, None, :] > last_key[:, :, None]  # [B, Qm, S]
    mask = torch.from_numpy(hidden).to(dev)[:, :, None, :].expand(b, qm, g, s).reshape(b, qm * g, s)
    q = p.query[torch.from_numpy(tok).to(dev)].float().view(b, qm, hkv, g, d)
    q = q.permute(2, 0, 1, 3, 4).reshape(hkv, b, qm * g, d)
    scores = torch.matmul(q, k.transpose(2, 3))  # [Hkv, B, Qm*G, S]
    scores.mul_(p.scale).masked_fill_(mask[None], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, B, Qm*G, D]
    o = o.view(hkv, b, qm, g, d).permute(1, 2, 0, 3, 4).reshape(b, qm, hq, d)
    valid = within < q_lens[:, None]
    p.out[torch.from_numpy(tok[valid]).to(dev)] = o[torch.from_numpy(valid).to(dev)].to(p.out.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, enable_gqa: bool,
          attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on ``[H, L, D]`` through a batch of one: on CPU only 4-d inputs take
    the flash kernel (3-d ones fall back to the math path, 3-5x slower).
    Causal when there is no mask."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=attn_mask,
                                          is_causal=attn_mask is None, scale=scale,
                                          enable_gqa=enable_gqa)[0]


def _prefill_one(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    start: int,
    q_len: int,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention for one request's query chunk with a cached prefix."""
    block_size = kv_cache.shape[2]
    blocks = block_row[: _cdiv(seq_len, block_size)].long()
    k, v = _gather_kv(kv_cache, blocks, seq_len)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    if query.device.type == "cpu":
        _prefill_split(query[start : start + q_len], k, v, scale, out[start : start + q_len])
        return
    _prefill_masked(query, k, v, (start, q_len, seq_len - q_len), scale, out)


def _prefill_split(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_rows: torch.Tensor) -> None:
    """CPU: the chunk's queries against the cached prefix (every key visible:
    no mask) and against their own keys (causal, square: the flash kernel
    skips the hidden half), merged by their log-sum-exps. A mask over the
    whole prefix kept the flash kernel from skipping anything and cost
    1.4-1.8x the work at 8k context (bench/scaling.py, issue 29)."""
    ctx = k.shape[1] - q_rows.shape[0]  # cached prefix keys
    q = q_rows.float().transpose(0, 1)[None]  # [1, Hq, n, D]
    o, lse = _FLASH_CPU(q, k[None, :, ctx:], v[None, :, ctx:], 0.0, True, scale=scale)
    if ctx:
        o_pre, lse_pre = _FLASH_CPU(q, k[None, :, :ctx], v[None, :, :ctx], 0.0, False, scale=scale)
        # softmax over both key sets = each part's softmax weighted by its share of exp mass
        o = o.add_(o_pre.sub_(o).mul_(torch.sigmoid(lse_pre - lse)[..., None]))
    out_rows.copy_(o[0].transpose(0, 1))


def _prefill_masked(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: tuple[int, int, int],
                    scale: float, out: torch.Tensor) -> None:
    """Any device: SDPA per query slice, causal mask offset by the prefix.
    ``rows``: (first query token, query length, cached prefix length)."""
    start, q_len, ctx = rows
    gqa = query.shape[1] != k.shape[0]
    for a in range(0, q_len, _PREFILL_CHUNK):
        b = min(q_len, a + _PREFILL_CHUNK)
        q = query[start + a : start + b].float().transpose(0, 1)  # [Hq, n, D]
        kv_end = ctx + b  # keys visible to the last query row of this slice
        kk, vv = k[:, :kv_end], v[:, :kv_end]
        if ctx + a == 0:
            o = _sdpa(q, kk, vv, scale, gqa)
        else:
            pos = ctx + torch.arange(a, b, device=q.device)
            mask = torch.arange(kv_end, device=q.device)[None, :] <= pos[:, None]
            o = _sdpa(q, kk, vv, scale, gqa, attn_mask=mask)
        out[start + a : start + b] = o.transpose(0, 1).to(out.dtype)


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc_cpu: np.ndarray,
    seq_lens_cpu: np.ndarray,
    scale: float,
) -> torch.Tensor:
    """Varlen paged attention; returns ``[T, Hq, D]`` in the query dtype.

    Rows not owned by any request (batch padding past ``query_start_loc[-1]``)
    are zero.
    """
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    qsl = np.asarray(query_start_loc_cpu, dtype=np.int64)
    lens = np.asarray(seq_lens_cpu, dtype=np.int64)
    q_lens = qsl[1:] - qsl[:-1]
    decode = np.nonzero(q_lens == 1)[0]
    short = np.nonzero((q_lens > 1) & (q_lens <= _SHORT_QUERY))[0]
    # Drafts this step: the drafting requests take the short path, the others
    # stay on the decode path (padded to the longest query, a decode row
    # would cost up to _SHORT_QUERY times its own path: most of a batch where
    # few requests draft). Each request's K/V is still gathered once.
    p = _Paged(query, kv_cache, block_table, scale, out)
    if short.size:
        for sl in _by_length(p, lens[short]):
            _short_rows(p, qsl[short][sl], short[sl], q_lens[short][sl], lens[short][sl])
    if decode.size:
        for sl in _by_length(p, lens[decode]):
            _decode_rows(p, qsl[decode][sl], decode[sl], lens[decode][sl])
    for r in np.nonzero(q_lens > _SHORT_QUERY)[0]:
        _prefill_one(
            query, kv_cache, block_table[r], int(qsl[r]), int(q_lens[r]), int(lens[r]), scale, out
        )
    return out


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | np.ndarray,
    seq_lens: torch.Tensor | np.ndarray,
    scale: float,
) -> torch.Tensor:
    """Plain-loop reference (tests only), computed in fp64 so it is the exact
    answer to within fp32's last bit. Returns fp32 ``[T, Hq, D]``.

    Rows not owned by a request stay zero.
    """
    num_tokens, num_q, dim = query.shape
    block_size, num_kv = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q // num_kv
    qsl = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    out = torch.zeros(num_tokens, num_q, dim, dtype=torch.float32)
    for r, seq_len in enumerate(lens):
        keys, vals = [], []
        for p in range(seq_len):
            blk = int(block_table[r, p // block_size])
            keys.append(kv_cache[blk, 0, p % block_size].double().cpu())
            vals.append(kv_cache[blk, 1, p % block_size].double().cpu())
        if not keys:
            continue
        k = torch.stack(keys).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = torch.stack(vals).repeat_interleave(group, dim=1)
        q_len = qsl[r + 1] - qsl[r]
        for i in range(q_len):
            t = qsl[r] + i
            pos = seq_len - q_len + i  # attends to keys 0..pos
            q = query[t].double().cpu()  # [Hq, D]
            scores = (k[: pos + 1] * q).sum(-1) * scale  # [pos+1, Hq]
            probs = torch.softmax(scores, dim=0)
            out[t] = (probs[:, :, None] * v[: pos + 1]).sum(0).float()
    return out


class TorchAttentionBackend:
    """Reference backend; works on any device, tuned for CPU."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention_torch(
            query, kv_cache, meta.block_table, meta.query_start_loc_cpu, meta.seq_lens_cpu, scale
        )
