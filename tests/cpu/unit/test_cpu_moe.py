"""The grouped CPU experts op (conveyor/kernels/cpu_moe.py) on every kernel
table this CPU runs: bit for bit the per-expert arithmetic it replaces (each
expert's rows through the small-M linear of the same table, silu·mul, the
router-weighted sum in ascending expert order), close to the dense reference,
an expert-parallel rank's share, and its refusals."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_attention, cpu_linear, cpu_moe
from conveyor.workers.layers.moe import dense_reference, route_topk


def _tables() -> list[str]:
    if not cpu_attention.available():
        return []
    return [t for t in cpu_linear.supported_isas() if t in cpu_linear.ENGINE_ISAS]


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype),
            (torch.randn(e, h, i, generator=g) * 0.2).to(dtype))


def _per_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor],
                first: int, isa: str) -> torch.Tensor:
    """The loop the op replaces, on the same kernel table."""
    ext = cpu_attention.load_extension()
    weights, ids = topk
    out = torch.zeros(x.shape, dtype=torch.float32)
    for local in range(w13.shape[0]):
        tok, slot = (ids == first + local).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = cpu_linear.small_linear(x[tok], cpu_linear.pack(w13[local]), w13.shape[1], None, isa)
        y = cpu_linear.small_linear(ext.silu_and_mul(h), cpu_linear.pack(w2[local]), w2.shape[1], None, isa)
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def _routed(t: int, e: int, k: int, h: int, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype)
    return x, route_topk(torch.randn(t, e, generator=g), k, renormalize=True)


# (experts, top_k, hidden, intermediate): 2I and H on and off the 16-column
# blocks; hidden past one fp32 k chunk (1024).
SHAPES = [(8, 2, 32, 24), (6, 3, 40, 20), (4, 1, 1040, 16)]


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_grouped_is_the_per_expert_loop_bit_for_bit(isa: str, dtype: torch.dtype, shape: tuple[int, ...],
                                                     rows: int) -> None:
    if isa not in _tables():
        pytest.skip(f"this CPU does not run {isa} (or the kernel did not build)")
    e, k, h, i = shape
    w13, w2 = _weights(e, h, i, dtype)
    x, topk = _routed(rows, e, k, h, dtype)
    got = cpu_moe.experts(x, cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), i, topk, 0, isa)
    assert got.dtype == dtype and got.shape == (rows, h)
    assert torch.equal(got, _per_expert(x, w13, w2, topk, 0, isa))


@pytest.mark.parametrize("rows", [1, 33])
def test_grouped_fp32_is_close_to_the_dense_reference(rows: int) -> None:
    if not _tables():
        pytest.skip("the CPU kernel did not build")
    e, k, h, i = SHAPES[1]
    w13, w2 = _weights(e, h, i, torch.float32)
    x, (weights, ids) = _routed(rows, e, k, h, torch.float32)
    got = cpu_moe.experts(x, cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), i, (weights, ids), 0,
                          _tables()[0])
    torch.testing.assert_close(got, dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)


def test_an_expert_parallel_rank_computes_only_its_experts() -> None:
    """Rank r of 2 holds experts [4r, 4r + 4): the two partial sums add up to
    the whole, and a token routed only to the other rank's experts gets zeros."""
    if not _tables():
        pytest.skip("the CPU kernel did not build")
    isa = _tables()[0]
    w13, w2 = _weights(8, 32, 24, torch.float32)
    x, (weights, ids) = _routed(9, 8, 2, 32, torch.float32)
    ids[0] = torch.tensor([5, 6])  # token 0: rank 1's experts only
    whole = cpu_moe.experts(x, cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), 24, (weights, ids), 0, isa)
    parts = [cpu_moe.experts(x, cpu_moe.pack_experts(w13[4 * r:4 * r + 4]), cpu_moe.pack_experts(w2[4 * r:4 * r + 4]),
                             24, (weights, ids), 4 * r, isa) for r in range(2)]
    assert torch.equal(parts[0][0], torch.zeros(32))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-6, atol=1e-7)
    none_local = cpu_moe.experts(x, cpu_moe.pack_experts(w13[:2]), cpu_moe.pack_experts(w2[:2]), 24,
                                 (weights, torch.full_like(ids, 7)), 0, isa)
    assert torch.equal(none_local, torch.zeros_like(x))


def test_mismatched_weights_are_refused() -> None:
    if not _tables():
        pytest.skip("the CPU kernel did not build")
    isa = _tables()[0]
    w13, w2 = _weights(4, 32, 24, torch.float32)
    x, topk = _routed(3, 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="moe experts: w13 does not have 2 \\* inter"):
        cpu_moe.experts(x, cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), 40, topk, 0, isa)
    with pytest.raises(RuntimeError, match="moe experts: w13 has k"):
        cpu_moe.experts(x[:, :16], cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), 24, topk, 0, isa)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        cpu_moe.experts(x.bfloat16(), cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), 24, topk, 0, isa)


def test_each_call_gets_the_kernel_measured_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    # AVX-512 fp32: the table up to 48 mean rows per expert, then the loop
    # (None); AVX2: the table at every row count; bf16 on AMX: tiles always.
    assert cpu_moe.kernel_for("avx512", torch.float32, 48 * 16, 16) == "avx512"
    assert cpu_moe.kernel_for("avx512", torch.float32, 48 * 16 + 1, 16) is None
    assert cpu_moe.kernel_for("avx2", torch.float32, 10_000, 16) == "avx2"
    monkeypatch.setattr(cpu_moe, "_AMX", [False])
    assert cpu_moe.kernel_for("avx512bf16", torch.bfloat16, 16 * 16, 16) == "avx512bf16"
    assert cpu_moe.kernel_for("avx512bf16", torch.bfloat16, 17 * 16, 16) is None
    monkeypatch.setattr(cpu_moe, "_AMX", [True])
    assert cpu_moe.kernel_for("avx512bf16", torch.bfloat16, 10_000, 16) == "amx"
    assert cpu_moe.kernel_for("avx2", torch.bfloat16, 16, 16) == "avx2"  # an ISA cap holds


def _amx_or_skip() -> None:
    if not _tables() or not cpu_moe.amx_ready():
        pytest.skip("this CPU (or build) has no AMX-BF16")


@pytest.mark.parametrize("shape", [(8, 2, 64, 32), (4, 3, 1056, 96)])
@pytest.mark.parametrize("rows", [1, 15, 17, 64, 300])
def test_amx_tiles_agree_with_the_bf16_dot_kernel(shape: tuple[int, ...], rows: int) -> None:
    """AMX sums the same exact bf16 products in fp32 in another order: within
    one bf16 rounding of the vdpbf16ps kernel per GEMM, and the rows past the
    last (A tiles read 16) never reach the output."""
    _amx_or_skip()
    e, k, h, i = shape
    w13, w2 = _weights(e, h, i, torch.bfloat16)
    x, topk = _routed(rows, e, k, h, torch.bfloat16)
    p13, p2 = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2)
    amx = cpu_moe.experts(x, p13, p2, i, topk, 0, "amx")
    dot = cpu_moe.experts(x, p13, p2, i, topk, 0, "avx512bf16")
    assert amx.dtype == torch.bfloat16 and torch.isfinite(amx.float()).all()
    torch.testing.assert_close(amx.float(), dot.float(), rtol=2 ** -6, atol=2 ** -6 * dot.float().abs().max().item())
    ref = dense_reference(x.float(), w13.float(), w2.float(), *topk)
    torch.testing.assert_close(amx.float(), ref, rtol=2 ** -6, atol=2 ** -6 * ref.abs().max().item())


def test_amx_falls_back_to_the_table_off_its_sizes() -> None:
    """Sizes not a multiple of 32 (and fp32) run the best table, bit for bit."""
    _amx_or_skip()
    e, k, h, i = SHAPES[0]  # intermediate 24
    w13, w2 = _weights(e, h, i, torch.bfloat16)
    x, topk = _routed(9, e, k, h, torch.bfloat16)
    p13, p2 = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2)
    assert torch.equal(cpu_moe.experts(x, p13, p2, i, topk, 0, "amx"), _per_expert(x, w13, w2, topk, 0, "avx512bf16"))
