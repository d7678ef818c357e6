"""GPU correctness of the Triton attention kernels against the torch backend.

Skipped unless a CUDA device is present (and TRITON_INTERPRET is not 1).
Error metric: ``max|out - ref| / max|ref|``; the reference is the torch
backend (fp32 math; itself checked against the plain-loop reference on CPU).
Tolerances: bf16 1.5e-2, fp16 3e-3, fp32 2e-5 (IEEE dots, no TF32).
Seeds are random per run and printed on failure; KERNEL_TEST_SEED pins one.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("GPU kernel tests need CUDA (and TRITON_INTERPRET unset)", allow_module_level=True)
pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from conveyor.kernels.cache_write import write_kv  # noqa: E402
from conveyor.kernels.paged_attention import choose_num_segments, paged_attention  # noqa: E402
from conveyor.kernels.torch_attention import paged_attention_torch, write_kv_torch  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 2e-5}
torch.backends.cuda.matmul.allow_tf32 = False


def _seed() -> int:
    env = os.environ.get("KERNEL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def _specs(rng: np.random.Generator, n: int, max_len: int, decode_only: bool) -> list[tuple[int, int]]:
    """(query_len, seq_len) per request: decode / full prefill / chunk with cached prefix."""
    out = []
    for i in range(n):
        seq_len = int(rng.integers(1, max_len + 1))
        kind = 0 if decode_only else (i + int(rng.integers(3))) % 3
        if kind == 0 or seq_len < 3:
            out.append((1, seq_len))
        elif kind == 1:
            out.append((seq_len, seq_len))
        else:
            out.append((int(rng.integers(2, seq_len)), seq_len))
    return out


class GpuBatch:
    """Paged cache on the GPU; every slot without request data is NaN."""

    def __init__(self, seed: int, specs: list[tuple[int, int]], hq: int, hkv: int, d: int,
                 bs: int, dtype: torch.dtype) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        nblk = [-(-s // bs) for _, s in specs]
        num_blocks = 1 + sum(nblk) + 2
        self.cache = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
        perm = torch.randperm(num_blocks - 1, device=DEV, generator=gen) + 1
        self.block_table = torch.zeros(len(specs), max(nblk) + 1, dtype=torch.int32, device=DEV)
        used = 0
        for r, (_, seq_len) in enumerate(specs):
            self.block_table[r, : nblk[r]] = perm[used: used + nblk[r]].int()
            used += nblk[r]
            pos = torch.arange(seq_len, device=DEV)
            blocks = self.block_table[r, pos // bs].long()
            data = torch.randn(seq_len, 2, hkv, d, device=DEV, generator=gen)
            self.cache[blocks, :, pos % bs] = data.to(dtype)
        q_lens = [q for q, _ in specs]
        self.qsl_cpu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.seq_lens_cpu = np.array([s for _, s in specs], dtype=np.int32)
        self.qsl = torch.from_numpy(self.qsl_cpu).to(DEV)
        self.seq_lens = torch.from_numpy(self.seq_lens_cpu).to(DEV)
        self.query = torch.randn(int(self.qsl_cpu[-1]), hq, d, device=DEV, generator=gen).to(dtype)
        self.scale = d ** -0.5
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(s for _, s in specs)
        self.specs = specs

    def ref(self) -> torch.Tensor:
        return paged_attention_torch(self.query, self.cache, self.block_table, self.qsl_cpu,
                                     self.seq_lens_cpu, self.scale)

    def run(self, **kw) -> torch.Tensor:
        out = torch.full_like(self.query, float("nan"))
        paged_attention(self.query, self.cache, self.qsl, self.seq_lens, self.block_table, self.scale,
                        max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, out=out, **kw)
        return out


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int, what: str) -> None:
    torch.cuda.synchronize()
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{what}: {bad} non-finite outputs (seed={seed})"
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    assert err <= TOL[dtype], f"{what}: rel err {err:.3g} > {TOL[dtype]} (seed={seed})"


@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_mixed_batch_bf16(d, bs, hq, hkv) -> None:
    seed = _seed()
    rng = np.random.default_rng(seed)
    specs = _specs(rng, int(rng.integers(2, 9)), 2048, decode_only=False)
    b = GpuBatch(seed, specs, hq, hkv, d, bs, torch.bfloat16)
    _check(b.run(), b.ref(), torch.bfloat16, seed, f"mixed d={d} bs={bs} specs={specs}")


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_decode_bf16_default_path(d, bs) -> None:
    """Few long decodes: the heuristic picks split-KV on a full-size GPU."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    specs = _specs(rng, int(rng.integers(1, 4)), 20000, decode_only=True)
    specs[0] = (1, 16384 + int(rng.integers(0, 3000)))
    b = GpuBatch(seed, specs, 32, 8, d, bs, torch.bfloat16)
    _check(b.run(), b.ref(), torch.bfloat16, seed, f"decode d={d} bs={bs} specs={specs}")


@pytest.mark.parametrize("segs", [1, 2, 8, 64])
def test_split_kv_forced(segs) -> None:
    seed = _seed()
    specs = _specs(np.random.default_rng(seed), 5, 9000, decode_only=True)
    b = GpuBatch(seed, specs, 32, 8, 128, 16, torch.bfloat16)
    _check(b.run(num_segments=segs), b.ref(), torch.bfloat16, seed, f"segs={segs} specs={specs}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d,bs", [(128, 16), (256, 32), (80, 16), (64, 64)])
def test_other_dtypes(dtype, d, bs) -> None:
    seed = _seed()
    rng = np.random.default_rng(seed)
    specs = _specs(rng, 6, 1500, decode_only=False)
    b = GpuBatch(seed, specs, 16, 4, d, bs, dtype)
    _check(b.run(), b.ref(), dtype, seed, f"{dtype} d={d} bs={bs} specs={specs}")


@pytest.mark.parametrize("num_segments", [1, None])
def test_cuda_graph_replay(num_segments) -> None:
    """Captured once, replayed with new lengths/queries: no host reads inside."""
    seed = _seed()
    specs = [(1, 12000), (1, 3000), (1, 40)]
    b = GpuBatch(seed, specs, 32, 8, 128, 16, torch.bfloat16)
    out = torch.empty_like(b.query)

    def step() -> None:
        paged_attention(b.query, b.cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                        max_query_len=1, max_seq_len=12000, out=out, num_segments=num_segments)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = np.array([11000, 17, 40], dtype=np.int32)
    b.seq_lens.copy_(torch.from_numpy(new_lens))
    b.query.copy_(torch.randn_like(b.query))
    graph.replay()
    ref = paged_attention_torch(b.query, b.cache, b.block_table, b.qsl_cpu, new_lens, b.scale)
    _check(out, ref, torch.bfloat16, seed, f"graph segs={num_segments}")


def test_heuristic_on_this_gpu() -> None:
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert choose_num_segments(1, 8, 1, 16384, 16, sms) > 1
    assert choose_num_segments(256, 8, 1, 16384, 16, sms) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_write(dtype) -> None:
    seed = _seed()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    num_blocks, bs, hkv, d, t = 64, 16, 8, 128, 700
    slots = torch.randperm(num_blocks * bs, device=DEV, generator=gen)[:t]
    slots[::5] = -1
    kv = torch.randn(t, 3 * hkv, d, device=DEV, generator=gen).to(dtype)
    key, value = kv[:, :hkv], kv[:, hkv: 2 * hkv]
    a = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    b = a.clone()
    write_kv(key, value, a, slots)
    write_kv_torch(key, value, b, slots)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 512])
def test_fused_moe_matches_the_dense_reference(dtype: torch.dtype, rows: int) -> None:
    """The Triton grouped-GEMM MoE (conveyor/kernels/fused_moe.py), 16 experts
    top-4 (Qwen3-MoE-shaped), against every token through every expert."""
    from conveyor.kernels.fused_moe import fused_moe
    from conveyor.workers.layers.moe import dense_reference, route_topk

    g = torch.Generator(device=DEV).manual_seed(rows)
    e, h, i = 16, 256, 128
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=DEV) * 0.05).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=DEV) * 0.05).to(dtype)
    x = torch.randn(rows, h, generator=g, device=DEV).to(dtype)
    weights, ids = route_topk(torch.randn(rows, e, generator=g, device=DEV), 4, True)
    got = fused_moe(x, w13, w2, weights, ids).float()
    ref = dense_reference(x.float(), w13.float(), w2.float(), weights, ids).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < (1.5e-2 if dtype == torch.bfloat16 else 2e-5), err
