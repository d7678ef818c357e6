"""The small-M linear op (conveyor/kernels/cpu_linear.py) on every kernel table this
CPU runs, against float64 math, and its use by conveyor.parallel.layers.linear.

Tolerances, from the standard bound on a sum of K products in fp32 (each
FMA or add rounds once, relative error u = 2^-24 per operation, in any
order): |y - exact| <= K * u * sum_k |x_k w_k|. The tests allow twice that
(the order of the kernel's lane-wise sums differs from any reference's, so
bit equality is not expected). bf16 weights and inputs are exact in fp32 and
vdpbf16ps' products are exact, so the same bound holds before the output's
one rounding to bf16, which adds at most half a bf16 ulp of |y|; the test
allows one ulp (2^-8 |y|) plus the fp32 bound.
"""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_attention

_U = 2.0 ** -24
# (M, K, N): a lone row, row-block tails (AVX2 blocks 6 rows, 5 for bf16
# widened), two full AVX2 blocks, odd K (bf16 pairs padded), column counts off
# the 16-column blocks, the 16-row cap, a K past one chunk (512 k, fp32 1024:
# sums carried through y), 64 rows, and rows past one
# m-block (K = 4100: 18 rows a block on AVX2, 16 on AVX-512, with a tail).
_CASES = [(1, 64, 48), (3, 45, 7), (8, 96, 50), (13, 131, 33), (12, 40, 24), (16, 32, 3), (7, 1100, 20),
          (64, 72, 40), (61, 4100, 20)]


def _ext_or_skip() -> None:
    if not cpu_attention.available():
        pytest.skip(f"the CPU kernel did not build: {cpu_attention.build_error()}")


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2 * x.shape[1] * _U * (x.double().abs() @ w.double().abs().t())


def _isa_or_skip(isa: str) -> None:
    _ext_or_skip()
    from conveyor.kernels.cpu_linear import supported_isas

    if isa not in supported_isas():
        pytest.skip(f"this CPU does not run {isa}")


def _case(seed: int, m: int, k: int, n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    # x a column slice of a wider tensor: rows strided, as a narrowed input.
    x = torch.randn(m, k + 6, generator=g)[:, 3:k + 3].to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_small_linear_fp32_matches_float64(isa: str) -> None:
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import pack, small_linear
    for seed, (m, k, n) in enumerate(_CASES):
        x, w, b = _case(seed, m, k, n, torch.float32)
        exact = x.double() @ w.double().t() + b.double()
        for bias in (None, b):
            y = small_linear(x, pack(w), n, bias, isa)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            ref = exact if bias is not None else exact - b.double()
            err = (y.double() - ref).abs()
            assert bool((err <= _bound(x, w) + 1e-30).all()), f"{isa} {m}x{k}x{n}: max err {err.max()}"
        # And F.linear (oneDNN/MKL, its own order) within the sum of both bounds.
        assert bool(((y - torch.nn.functional.linear(x, w, b)).abs().double() <= 2 * _bound(x, w)).all())
        # x is read in place when its k are contiguous, else through x^T: the
        # same FMAs in the same order, so the same bits.
        xt = torch.empty(k, m + 1)[:, :m].t().copy_(x)
        assert xt.stride(1) != 1 and torch.equal(small_linear(xt, pack(w), n, b, isa), y), (isa, m, k, n)


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_small_linear_bf16_is_fp32_math_rounded_once(isa: str) -> None:
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import pack, small_linear
    for seed, (m, k, n) in enumerate(_CASES):
        x, w, b = _case(seed, m, k, n, torch.bfloat16)
        y = small_linear(x, pack(w), n, b, isa)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        exact = x.double() @ w.double().t() + b.double()
        err = (y.double() - exact).abs()
        tol = exact.abs() * 2.0 ** -8 + _bound(x, w)
        assert bool((err <= tol).all()), f"{isa} {m}x{k}x{n}: max err {err.max()}"


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_small_linear_int8_matches_float64_on_the_dequantized_weight(isa: str) -> None:
    """Weight-only int8 (packed like fp32): (x @ q^T) * scale + bias within
    the fp32 bound, on every shape of _CASES (1-3 rows take 4 or 2 FMA chains
    over k with a tail when K is not a multiple; K past a chunk)."""
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import dequant_i8, pack, small_linear_i8, unpack
    from conveyor.workers.layers.quant import quantize_int8
    for seed, (m, k, n) in enumerate(_CASES + [(2, 131, 17), (1, 1029, 40)]):
        x, w, b = _case(seed, m, k, n, torch.float32)
        q, scale = quantize_int8(w)
        assert torch.equal(unpack(pack(q), n), q)
        # Prefill's weight: the one-pass op gives the torch ops' bits.
        assert torch.equal(dequant_i8(pack(q), n, scale), q.float() * scale[:, None])
        exact = (x.double() @ q.double().t()) * scale.double() + b.double()
        y = small_linear_i8(x, pack(q), n, scale, b, isa)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        bound = _bound(x, q.float()) * scale.double() + exact.abs() * 2 * _U
        assert bool(((y.double() - exact).abs() <= bound + 1e-30).all()), f"{isa} {m}x{k}x{n}"

@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_int8_prefill_tiles_match_float64_on_the_dequantized_weight(isa: str) -> None:
    """Prefill rows of an int8 linear (linear_i8_tiled: on AVX-512 the int8
    GEMM, which widens each panel of the weight in cache; else the weight
    dequantized a tile of columns at a time for torch's GEMM): within the fp32
    GEMM bound of the exact product over dequant_i8's weight, bias added; N off
    the 16-column blocks and an odd number of blocks (the GEMM's last panel one
    block), K = 4096 makes 256-column tiles (600 columns: two full tiles and a
    short one ending inside a block) and 11 k chunks of the GEMM, 300 rows two
    passes of its row tiles and a short last tile, strided rows in x;
    quant.int8_linear sends 17-1024 rows there and its result is that op's."""
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import dequant_i8, kernel_isa, linear_i8_tiled, pack
    from conveyor.workers.layers.quant import INT8_KERNEL_ROWS, INT8_TILED_ROWS, int8_linear, quantize_int8
    for seed, (m, k, n) in enumerate([(40, 4096, 600), (17, 64, 17), (5, 300, 33), (300, 500, 80)]):
        x, w, b = _case(seed, m, k, n, torch.float32)
        q, scale = quantize_int8(w)
        deq = dequant_i8(pack(q), n, scale)
        for bias in (b, None):
            y = linear_i8_tiled(x, pack(q), n, scale, bias, isa)
            assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
            exact = x.double() @ deq.double().t() + (bias.double() if bias is not None else 0)
            bound = _bound(x, deq) + exact.abs() * 2 * _U
            assert bool(((y.double() - exact).abs() <= bound + 1e-30).all()), f"{m}x{k}x{n}"
        if INT8_KERNEL_ROWS < m <= INT8_TILED_ROWS and isa == kernel_isa():
            assert torch.equal(int8_linear(x, b, packed=pack(q), scale=scale),
                               linear_i8_tiled(x, pack(q), n, scale, b, isa))


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_small_linear_bf16_output_rounds_as_torch(isa: str) -> None:
    """The kernel rounds its bf16 output itself: with x = 0 the output is the
    fp32 bias rounded once, bit for bit torch's rounding (nearest, ties to
    even both ways, overflow to inf, denormals), NaN stays NaN; the
    wide tables' bf16 output is their fp32 result rounded, bit for bit."""
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import pack, small_linear
    one = 1.0
    ties = [one + 2.0 ** -8, one + 3 * 2.0 ** -8, -(one + 2.0 ** -8), 3.0 + 2.0 ** -7]
    near = [one + 2.0 ** -8 + 2.0 ** -20, one + 2.0 ** -8 - 2.0 ** -20, 1e-40, -3e-39, 3.4e38,
            float("inf"), -float("inf"), 65504.0, 1e-3]
    bias = torch.tensor(ties + near + [float("nan")] * 3, dtype=torch.float32)
    n = bias.numel()
    w = torch.randn(n, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for m in (1, 7, 16):
        y = small_linear(torch.zeros(m, 32, dtype=torch.bfloat16), pack(w), n, bias, isa)
        want = bias.to(torch.bfloat16).expand(m, n)
        nan = torch.isnan(want)
        assert bool(torch.isnan(y)[nan].all())
        assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16)), isa
    if isa == "avx512bf16":
        return  # vdpbf16ps sums pairs its own way: no fp32 twin
    for seed, (m, k, n) in enumerate(_CASES):
        x, w, b = _case(seed, m, k, n, torch.bfloat16)
        y = small_linear(x, pack(w), n, b, isa)
        y32 = small_linear(x.float(), pack(w.float()), n, b.float(), isa)
        assert torch.equal(y.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16)), (isa, m, k, n)

# (M, K, N) for the plain kernel (up to 4 rows): K below one vector and off
# the vector width (the scalar tail), N off every tile width (6, 4 and 3
# columns, the 48-column thread unit), a K of several thousand.
_PLAIN_CASES = [(1, 5, 7), (1, 64, 48), (2, 45, 50), (3, 131, 97), (4, 40, 6), (4, 4100, 20), (3, 17, 13)]


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_plain_linear_fp32_matches_float64(isa: str) -> None:
    """The plain kernel over w as it is (its row stride wider than K too),
    strided x rows, with and without a bias, within the fp32 bound."""
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import plain_linear

    for i, (m, k, n) in enumerate(_PLAIN_CASES):
        x, w, b = _case(100 + i, m, k, n, torch.float32)
        wide = torch.randn(n, k + 9)
        wide[:, 2:k + 2] = w
        for weight in (w, wide[:, 2:k + 2]):
            for bias in (b, None):
                y = plain_linear(x, weight, bias, isa)
                ref = x.double() @ w.double().t() + (b.double() if bias is not None else 0)
                assert y.shape == (m, n) and y.dtype == torch.float32
                assert bool(((y.double() - ref).abs() <= _bound(x, w)).all()), (isa, m, k, n)


def test_engine_decode_rows_within_the_plain_kernel_pack_no_copy() -> None:
    """A layer whose engine's decode steps fit the plain kernel
    (mark_decode_rows) runs larger chunks on the weight itself (fp32 oneDNN,
    bf16 F.linear): no packed copy."""
    _ext_or_skip()
    cpu_attention.load_extension()
    from conveyor.kernels import cpu_linear
    from conveyor.parallel.layers import linear, mark_decode_rows

    isa = cpu_linear.kernel_isa()
    if isa is None:
        pytest.skip(f"the engine keeps oneDNN on the {cpu_attention.isa()} table")
    assert cpu_linear.small_rows(isa, torch.float32, 4) == 0 and cpu_linear.small_rows(isa, torch.float32, 5) == 64
    holder, w, x = torch.nn.Module(), torch.randn(40, 72), torch.randn(16, 72)
    mark_decode_rows(holder, 4)
    y = linear(holder, x, w)
    assert not [k for k in holder.__dict__ if "packed" in k]
    assert bool(((y - x @ w.t()).abs().double() <= 2 * _bound(x, w)).all())
    if cpu_linear.plain_rows(isa, torch.bfloat16):  # bf16 packs no oneDNN copy either
        mark_decode_rows(holder, 2)
        y = linear(holder, x.bfloat16(), w.bfloat16())
        assert not [k for k in holder.__dict__ if "packed" in k] and y.dtype == torch.bfloat16
    mark_decode_rows(holder, 5)
    linear(holder, x, w)
    assert "_small_packed" in holder.__dict__


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_plain_linear_bf16_is_fp32_math_rounded_once(isa: str) -> None:
    """bf16 on the plain kernel (vdpbf16ps tables only; the others refuse):
    within the fp32 bound of the exact sum, plus one rounding to bf16."""
    _isa_or_skip(isa)
    from conveyor.kernels.cpu_linear import plain_linear

    for i, (m, k, n) in enumerate(_PLAIN_CASES):
        x, w, b = _case(200 + i, m, k, n, torch.bfloat16)
        if isa != "avx512bf16":
            with pytest.raises(RuntimeError, match="no bf16 kernel"):
                plain_linear(x, w, b, isa)
            return
        y = plain_linear(x, w, b, isa)
        ref = x.double() @ w.double().t() + b.double()
        tol = ref.abs() * 2.0 ** -8 + _bound(x, w)
        assert y.dtype == torch.bfloat16 and bool(((y.double() - ref).abs() <= tol).all()), (m, k, n)


def test_plain_linear_takes_empty_inputs() -> None:
    _ext_or_skip()
    from conveyor.kernels.cpu_linear import plain_linear, supported_isas

    for isa in supported_isas():
        assert plain_linear(torch.randn(0, 16), torch.randn(8, 16), None, isa).shape == (0, 8)
        assert plain_linear(torch.randn(2, 16), torch.randn(0, 16), None, isa).shape == (2, 0)


def test_plain_linear_refuses_more_rows_than_its_tiles() -> None:
    _ext_or_skip()
    from conveyor.kernels.cpu_linear import PLAIN_ROWS, plain_linear, supported_isas

    x, w, _ = _case(6, PLAIN_ROWS + 1, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="M <= 4"):
        plain_linear(x, w, None, supported_isas()[0])


def test_plain_linear_rows_do_not_depend_on_the_batch_or_threads() -> None:
    """Each row's sums run in one fixed order: a row computed alone, within a
    batch, or with another thread split gives the same bits."""
    _ext_or_skip()
    from conveyor.kernels.cpu_linear import plain_linear, supported_isas

    x, w, b = _case(5, 4, 300, 101, torch.float32)
    threads = torch.get_num_threads()
    for isa in supported_isas():
        y = plain_linear(x, w, b, isa)
        for r in range(4):
            assert torch.equal(plain_linear(x[r:r + 1], w, b, isa)[0], y[r]), (isa, r)
        torch.set_num_threads(1)
        try:
            assert torch.equal(plain_linear(x, w, b, isa), y), isa
        finally:
            torch.set_num_threads(threads)


def test_layers_linear_takes_the_small_kernel_only_for_decode_rows() -> None:
    """conveyor.parallel.layers.linear, fp32: the plain kernel up to PLAIN_ROWS,
    the packed one up to its row limit (same bits as direct calls), oneDNN
    over the weight itself above; results agree either way, and the layer
    keeps no copy of its weights until a packed-kernel call."""
    _ext_or_skip()
    cpu_attention.load_extension()
    from conveyor.kernels.cpu_linear import PLAIN_ROWS, kernel_isa, pack, plain_linear, small_linear, small_rows
    from conveyor.parallel.layers import linear

    isa = kernel_isa()
    if isa is None:
        pytest.skip(f"the engine keeps oneDNN on the {cpu_attention.isa()} table")
    lim = small_rows(isa, torch.float32)
    holder = torch.nn.Module()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 72, generator=g)
    for m in (1, PLAIN_ROWS, PLAIN_ROWS + 1, lim, lim + 1, 300):
        x = torch.randn(m, 72, generator=g)
        y = linear(holder, x, w)
        if m <= PLAIN_ROWS:
            assert torch.equal(y, plain_linear(x, w, None, isa)) and not holder.__dict__.get("_small_packed")
        elif m <= lim:
            assert torch.equal(y, small_linear(x, pack(w), 40, None, isa))
        assert bool(((y - x @ w.t()).abs().double() <= 2 * _bound(x, w)).all())
    assert "_small_packed" in holder.__dict__ and "_packed_weight" not in holder.__dict__


@pytest.mark.parametrize("table", ["avx512", "avx2"])
def test_layers_linear_routes_each_engine_table_up_to_its_row_limit(table: str, monkeypatch) -> None:
    """With the attention backend on `table`, conveyor.parallel.layers.linear runs
    fp32 on the plain kernel up to 4 rows, the packed one up to 64 and oneDNN
    over the weight above (no copy of it); bf16 on the plain kernel up to 2
    rows where the table has vdpbf16ps, then the packed one up to 16 rows,
    except on AMX (oneDNN's packed bf16 GEMM)."""
    _ext_or_skip()
    if table not in cpu_attention.supported_isas():
        pytest.skip(f"this CPU does not run {table}")
    from conveyor.kernels import cpu_linear
    from conveyor.parallel.layers import linear

    calls: list[tuple[str, int, str]] = []
    real_small, real_plain = cpu_linear.small_linear, cpu_linear.plain_linear

    def spy_small(x, packed, n, b, isa):
        calls.append(("packed", x.shape[0], isa))
        return real_small(x, packed, n, b, isa)

    def spy_plain(x, w, b, isa):
        calls.append(("plain", x.shape[0], isa))
        return real_plain(x, w, b, isa)

    monkeypatch.setattr(cpu_linear, "small_linear", spy_small)
    monkeypatch.setattr(cpu_linear, "plain_linear", spy_plain)
    cpu_attention.load_extension()
    try:
        cpu_attention.select_isa(table)
        isa = cpu_linear.kernel_isa()
        assert isa is not None and isa.startswith(table)
        g = torch.Generator().manual_seed(3)
        for dtype in (torch.float32, torch.bfloat16):
            plain = 4 if dtype == torch.float32 else (2 if isa == "avx512bf16" else 0)
            lim = 64 if dtype == torch.float32 else (0 if cpu_linear.amx() else 16)
            assert cpu_linear.small_rows(isa, dtype) == lim and cpu_linear.plain_rows(isa, dtype) == plain
            w = torch.randn(40, 72, generator=g).to(dtype)
            holder = torch.nn.Module()
            for m in (1, 2, 3, 4, 5, 16, 17, 64, 65, 300):
                calls.clear()
                x = torch.randn(m, 72, generator=g).to(dtype)
                y = linear(holder, x, w)
                want = [("plain", m, isa)] if m <= plain else [("packed", m, isa)] if m <= lim else []
                assert calls == want, (dtype, m)
                ref = x.double() @ w.double().t()
                tol = ref.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 0) + 2 * _bound(x, w)
                assert bool(((y.double() - ref).abs() <= tol).all()), (dtype, m)
            # fp32 keeps no oneDNN copy; bf16 keeps oneDNN's (or its fp32 one where oneDNN has no bf16).
            onednn_copy = "_packed_weight" in holder.__dict__ or "_packed_weight_f32" in holder.__dict__
            assert ("_small_packed" in holder.__dict__) == (lim > 0), dtype
            assert onednn_copy == (dtype == torch.bfloat16), dtype
    finally:
        cpu_attention.select_isa("auto")


def test_fp32_prefill_rows_run_mkl_where_mkl_is_fast(monkeypatch) -> None:
    """fp32 linears above MKL_ROWS_F32 rows are MKL's F.linear (its bits) where
    oneDNN would pad the rows, and from MKL_ALIGNED_ROWS_F32 on; the rest run
    oneDNN over the weight. Where MKL is slow (AMD, no AVX-512) never MKL."""
    from conveyor.kernels import cpu_linear
    from conveyor.parallel import layers

    with open("/proc/cpuinfo") as f:
        info = f.read()
    intel_avx512 = "GenuineIntel" in info and " avx512f" in info and torch.backends.mkl.is_available()
    assert cpu_linear.mkl_avx512() == intel_avx512
    assert cpu_linear.f32_on_mkl(4096, True) == intel_avx512
    monkeypatch.setattr(cpu_linear, "mkl_avx512", lambda: True)
    onednn: list[int] = []
    real = layers._onednn

    def spy(x, w, b):
        onednn.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(layers, "_onednn", spy)
    monkeypatch.setattr(layers, "_kernel_isa", lambda x, w: None)  # no small-M kernels: oneDNN or MKL only
    monkeypatch.setattr(layers, "_small_isa", lambda module, x, w: None)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 200, generator=g), torch.randn(96, generator=g)
    lim, aligned = cpu_linear.MKL_ROWS_F32, cpu_linear.MKL_ALIGNED_ROWS_F32
    assert lim % 64 == 0 and aligned % 64 == 0
    for m, mkl in ((lim - 1, False), (lim, False), (lim + 1, True), (lim + 64, False), (700, True),
                   (aligned - 64, False), (aligned, True), (aligned + 64, True)):
        onednn.clear()
        x = torch.randn(m, 200, generator=g)
        y = layers.linear(torch.nn.Module(), x, w, b)
        if mkl:
            assert onednn == [] and torch.equal(y, torch.nn.functional.linear(x, w, b)), m
        else:
            assert onednn == [m], m
            assert bool(((y - torch.nn.functional.linear(x, w, b)).abs() <= 2 * _bound(x, w) + 1e-6).all()), m
