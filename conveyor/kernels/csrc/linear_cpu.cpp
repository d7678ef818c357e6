// The small-M linear CPU op: torch.ops.conveyor_linear.linear (registered with
// the dispatcher, so the attention glue's pybind module needs no change).
//
//   linear(x [M, K], packed, n, bias [n]?, isa) -> y [M, n] of x's dtype
// x fp32 or bf16, packed = cpu_linear.pack(w [n, K]) of the same dtype, bias
// any float dtype. Packed blocks are split over torch's threads, each thread
// one contiguous range. bf16: where the table has vdpbf16ps (avx512bf16) x's
// pairs go to it as they are; else x is widened to fp32 once and the weights
// in registers. Sums are fp32; a bf16 y is rounded once, to nearest even, by
// the kernel as it stores the last chunk.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "linear_tables.h"

namespace {
using conveyor_linear::LinearTable;

// The tables this CPU runs, best first: each name with its table.
std::vector<std::pair<std::string, const LinearTable*>> tables() {
  std::vector<std::pair<std::string, const LinearTable*>> out;
  if (conveyor_cpu::cpu_runs("avx512bf16") && conveyor_linear::linear_avx512bf16())
    out.emplace_back("avx512bf16", conveyor_linear::linear_avx512bf16());
  if (conveyor_cpu::cpu_runs("avx512") && conveyor_linear::linear_avx512())
    out.emplace_back("avx512", conveyor_linear::linear_avx512());
  if (conveyor_cpu::cpu_runs("avx2") && conveyor_linear::linear_avx2())
    out.emplace_back("avx2", conveyor_linear::linear_avx2());
  out.emplace_back("portable", conveyor_linear::linear_portable());
  return out;
}

const LinearTable* pick(const std::string& isa) { return conveyor_linear::table_named(isa); }

// Packed blocks per thread below which a call stays on one thread (the
// fork/join costs more than 16 KiB-ish of weights).
constexpr int64_t kGrainBlocks = 4;

// x [M, K] (any strides) as the kernel reads it: x^T fp32 [kp][m] (bf16 x
// widened, exact), or for vdpbf16ps x's bf16 pairs as uint32 [kp / 2][m]; k
// past K reads zeros (their weights are zero too). Written here rather than
// as torch ops: the transpose and casts cost ~15-30 us a call through
// TensorIterator, more than the kernel at small N. Tiles of kTile k keep the
// rows' source lines and the destination lines in L1 together.
constexpr int64_t kTile = 16;

template <typename T, typename F>
void transpose_into(const at::Tensor& x, int64_t cols, T* dst, F value) {
  const int64_t m = x.size(0);
  for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
    const int64_t c1 = std::min(c0 + kTile, cols);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = c0; c < c1; ++c) dst[c * m + i] = value(i, c);
  }
}

at::Tensor x_operand(const at::Tensor& x, int64_t kp, bool pairs) {
  const int64_t m = x.size(0), k = x.size(1), s0 = x.stride(0), s1 = x.stride(1);
  if (pairs) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::Tensor out = at::empty({kp / 2, m}, x.options().dtype(at::kInt));
    transpose_into(x, kp / 2, reinterpret_cast<uint32_t*>(out.data_ptr()), [&](int64_t i, int64_t c) {
      const uint16_t* r = src + i * s0 + 2 * c * s1;
      return static_cast<uint32_t>(r[0]) | (2 * c + 1 < k ? static_cast<uint32_t>(r[s1]) << 16 : 0u);
    });
    return out;
  }
  at::Tensor out = at::empty({kp, m}, x.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>();
    transpose_into(x, kp, dst, [&](int64_t i, int64_t c) { return c < k ? src[i * s0 + c * s1] : 0.f; });
  } else {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    transpose_into(x, kp, dst, [&](int64_t i, int64_t c) {
      const uint32_t u = c < k ? static_cast<uint32_t>(src[i * s0 + c * s1]) << 16 : 0u;
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    });
  }
  return out;
}

// x as the kernel reads it, with LinearArgs' strides: fp32 x whose k are
// contiguous is read in place, each row a k-sequential stream (no copy; the
// kernel ran 1.0-1.6x faster than over x^T at 4-64 rows on AVX2 and AVX-512,
// BENCHMARKS.md "x in place"); else x_operand's x^T [kp][m].
struct XOperand {
  at::Tensor t;
  int64_t xk, xm;
};

XOperand x_for_kernel(const at::Tensor& x, int64_t kp, bool pairs) {
  if (!pairs && x.scalar_type() == at::kFloat && x.size(1) == kp && x.stride(1) == 1)
    return {x, 1, x.stride(0)};
  return {x_operand(x, kp, pairs), x.size(0), 1};
}

// A per-column vector (bias, scale) as fp32 [np], zeros past n; undefined if absent.
at::Tensor padded(const c10::optional<at::Tensor>& v, int64_t n, int64_t np, const char* what) {
  if (!v.has_value()) return at::Tensor();
  TORCH_CHECK(v->numel() == n, "linear: ", what, " must have n values");
  return at::constant_pad_nd(v->to(at::kFloat).reshape({n}), {0, np - n}).contiguous();
}

// Weight-only int8: y = (x @ q^T) * scale (+ bias), x fp32 [M, K], packed =
// cpu_linear.pack(q [n, K] int8), scale fp32 [n]; fp32 sums, fp32 y.
at::Tensor small_linear_i8(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, c10::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_i8: x must be fp32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == conveyor_linear::kBlockN,
              "linear_i8: packed weight must come from cpu_linear.pack of an int8 weight");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), np = nb * conveyor_linear::kBlockN;
  TORCH_CHECK(packed.size(1) == k && n <= np && n > np - conveyor_linear::kBlockN,
              "linear_i8: packed weight does not match x's K or n");
  const LinearTable* t = pick(std::string(isa.data(), isa.size()));
  const XOperand xo = x_for_kernel(x, k, false);
  const at::Tensor b = padded(bias, n, np, "bias"), sc = padded(scale, n, np, "scale");
  at::Tensor y = at::empty({m, np}, x.options());
  const conveyor_linear::LinearArgs a{packed.data_ptr(), xo.t.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr,
                                      y.data_ptr<float>(), nullptr, sc.data_ptr<float>(), m, k, np, xo.xk, xo.xm};
  at::parallel_for(0, nb, kGrainBlocks, [&](int64_t lo, int64_t hi) { t->i8(a, lo, hi); });
  return np != n ? y.narrow(1, 0, n).contiguous() : y;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias, c10::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear: x must be fp32 or bf16 [M, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && packed.dim() == (bf16 ? 4 : 3) &&
                  packed.size(2) == conveyor_linear::kBlockN && (!bf16 || packed.size(3) == 2),
              "linear: packed weight must come from cpu_linear.pack for x's dtype");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0), np = nb * conveyor_linear::kBlockN;
  const int64_t kp = bf16 ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(kp == k + (bf16 ? k % 2 : 0) && n <= np && n > np - conveyor_linear::kBlockN,
              "linear: packed weight does not match x's K or n");
  const LinearTable* t = pick(std::string(isa.data(), isa.size()));
  const bool dot = bf16 && t->bf16_dot != nullptr;
  const XOperand xo = x_for_kernel(x, kp, dot);
  const at::Tensor b = padded(bias, n, np, "bias");
  // bf16: the kernel rounds the last chunk's sums into yb; y holds partial sums.
  at::Tensor y = at::empty({m, np}, x.options().dtype(at::kFloat));
  at::Tensor yb = bf16 ? at::empty({m, np}, x.options()) : at::Tensor();
  const conveyor_linear::LinearFn fn = !bf16 ? t->f32 : (dot ? t->bf16_dot : t->bf16_wide);
  const conveyor_linear::LinearArgs a{packed.data_ptr(), xo.t.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr,
                                      y.data_ptr<float>(),
                                      bf16 ? reinterpret_cast<uint16_t*>(yb.data_ptr()) : nullptr, nullptr,
                                      m, kp, np, xo.xk, xo.xm};
  at::parallel_for(0, nb, kGrainBlocks, [&](int64_t lo, int64_t hi) { fn(a, lo, hi); });
  at::Tensor out = bf16 ? yb : y;
  return np != n ? out.narrow(1, 0, n).contiguous() : out;
}

// Columns per thread-split unit of the plain op (a multiple of every table's
// tile widths, so only a range's last tile is narrow).
constexpr int64_t kPlainUnit = 48;

// y = x @ w^T (+ bias) over w [n, K] as it is (row-major, k contiguous), no
// packed copy (linear_plain.inc): fp32, or bf16 x and w on a table with
// vdpbf16ps (fp32 sums, y rounded once).
at::Tensor plain_linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        c10::string_view isa) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.dim() == 2 && (bf16 || x_in.scalar_type() == at::kFloat) &&
                  x_in.size(0) <= conveyor_linear::kPlainDotRows,
              "linear_plain: x must be fp32 or bf16 [M, K] with M <= ", conveyor_linear::kPlainDotRows);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == x_in.scalar_type() && w.size(1) == x_in.size(1) && w.stride(1) == 1,
              "linear_plain: w must be [n, K] of x's dtype with contiguous rows");
  const LinearTable* t = pick(std::string(isa.data(), isa.size()));
  const conveyor_linear::PlainFn fn = bf16 ? t->bf16_plain : t->f32_plain;
  TORCH_CHECK(fn != nullptr, "linear_plain: table '", t->name, "' has no bf16 kernel (it needs AVX512_BF16)");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t m = x.size(0), n = w.size(0);
  const at::Tensor b = bias.has_value() ? padded(bias, n, n, "bias") : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;  // the tiles' width divides by m
  const conveyor_linear::PlainArgs a{w.data_ptr(), x.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr,
                                     bf16 ? nullptr : y.data_ptr<float>(),
                                     bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr,
                                     m, x.size(1), w.stride(0), x.stride(0), n};
  const int64_t units = (n + kPlainUnit - 1) / kPlainUnit;
  at::parallel_for(0, units, 1, [&](int64_t lo, int64_t hi) { fn(a, lo * kPlainUnit, std::min(hi * kPlainUnit, n)); });
  return y;
}

// Weight-only int8 for rows past the small-M kernel: w [n, K] fp32 =
// q * scale[:, None] from packed = cpu_linear.pack(q), in one pass (the torch
// ops took three: unpack's copy, the widening, the scaling). Per 16-column
// block, each output row reads its column of the block's [K][16] bytes (in
// L1 after the first) and writes its K values in order.
at::Tensor dequant_i8(const at::Tensor& packed, int64_t n, const at::Tensor& scale) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == conveyor_linear::kBlockN,
              "dequant_i8: packed weight must come from cpu_linear.pack of an int8 weight");
  const int64_t nb = packed.size(0), k = packed.size(1), np = nb * conveyor_linear::kBlockN;
  TORCH_CHECK(n <= np && n > np - conveyor_linear::kBlockN && scale.numel() == n, "dequant_i8: n or scale mismatch");
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kFloat));
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* s = sc.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t c = 0; c < conveyor_linear::kBlockN; ++c) {
        const int64_t row = b * conveyor_linear::kBlockN + c;
        if (row >= n) break;
        const int8_t* src = q + b * k * conveyor_linear::kBlockN + c;
        float* dst = out + row * k;
        const float f = s[row];
        for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<float>(src[i * conveyor_linear::kBlockN]) * f;
      }
  });
  return w;
}

// Prefill-sized int8 linear: x [M, K] fp32 @ (q * scale)^T (+ bias) without a
// whole fp32 weight. The weight is dequantized a tile of columns at a time
// into a [K, cols] buffer (each packed block's 16 int8 per k become one
// 16-float run) that stays in cache for the tile's GEMM, which writes its
// columns of y in place (ldc = n): dequant_i8 wrote all of the fp32 weight to
// memory and the GEMM read it back. Each value is float(q) * scale,
// dequant_i8's; only the GEMM's summation order may differ. Tiles of 4 MiB,
// at least 256 columns (narrower GEMMs ran slower: at K = 8192, 32 columns
// ran 0.81x the whole-weight path). 1B shapes at 128 rows ran 1.3-2.3x
// dequant_i8 + GEMM, at 512 rows 1.0-1.33x, at 2048 level (0.90-1.06x).
// Where the isa's table has an int8 GEMM (AVX-512, linear_kernels.h) that runs
// instead: the same weight values, widened per panel in cache, one FMA per k.
constexpr int64_t kI8TileBytes = 4 << 20;
constexpr int64_t kI8TileMinBlocks = 16;

// linear_i8_tiled on the table's int8 GEMM: y [M, nb * 16], the caller narrows.
at::Tensor i8_gemm(conveyor_linear::I8GemmFn fn, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc) {
  using conveyor_linear::kI8ChunkK;
  using conveyor_linear::kI8Group;
  const int64_t nb = packed.size(0), panels = (nb + 1) / 2;
  at::Tensor y = at::empty({x.size(0), nb * conveyor_linear::kBlockN}, x.options());
  // 64-byte aligned scratch per thread (+16 floats of slack to align it).
  const int64_t per = kI8Group * kI8ChunkK * 32 + 16;
  at::Tensor scratch = at::empty({at::get_num_threads() * per}, x.options());
  conveyor_linear::I8GemmArgs args{x.data_ptr<float>(), packed.data_ptr<int8_t>(), sc.data_ptr<float>(),
                                   y.data_ptr<float>(), nullptr, x.size(0), x.size(1), nb, x.stride(0), y.size(1)};
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    conveyor_linear::I8GemmArgs mine = args;
    float* base = scratch.data_ptr<float>() + at::get_thread_num() * per;
    mine.scratch = base + ((64 - reinterpret_cast<uintptr_t>(base) % 64) % 64) / sizeof(float);
    fn(mine, lo, hi);
  });
  return y;
}

at::Tensor linear_i8_tiled(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, const std::string& isa) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == conveyor_linear::kBlockN,
              "linear_i8_tiled: packed weight must come from cpu_linear.pack of an int8 weight");
  constexpr int64_t B = conveyor_linear::kBlockN;
  const int64_t nb = packed.size(0), k = packed.size(1);
  TORCH_CHECK(n <= nb * B && n > (nb - 1) * B && scale.numel() == n, "linear_i8_tiled: n or scale mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == k, "linear_i8_tiled: x fp32 [M, K]");
  at::Tensor sc = at::zeros({nb * B}, x.options());  // padding columns scale to 0 (never stored)
  sc.narrow(0, 0, n).copy_(scale);
  if (const conveyor_linear::I8GemmFn fn = pick(isa)->i8_gemm) {
    at::Tensor y = i8_gemm(fn, x.stride(1) == 1 ? x : x.contiguous(), packed, sc);
    if (y.size(1) != n) y = y.narrow(1, 0, n).contiguous();
    if (bias.has_value()) y.add_(bias.value());
    return y;
  }
  const int64_t tile = std::max<int64_t>(kI8TileMinBlocks, kI8TileBytes / (k * B * 4));  // blocks per tile
  at::Tensor buf = at::empty({k, tile * B}, x.options());
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const at::Tensor xc = x.contiguous();
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* s = sc.data_ptr<float>();
  float* d = buf.data_ptr<float>();
  for (int64_t b0 = 0; b0 < nb; b0 += tile) {
    const int64_t b1 = std::min(nb, b0 + tile), ld = tile * B;
    at::parallel_for(0, k, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t kk = lo; kk < hi; ++kk)
        for (int64_t j = b0; j < b1; ++j) {
          const int8_t* src = q + (j * k + kk) * B;
          const float* f = s + j * B;
          float* dst = d + kk * ld + (j - b0) * B;
          for (int64_t c = 0; c < B; ++c) dst[c] = static_cast<float>(src[c]) * f[c];
        }
    });
    const int64_t c0 = b0 * B, cols = std::min(n, b1 * B) - c0;
    at::Tensor out = y.narrow(1, c0, cols);
    at::mm_out(out, xc, buf.narrow(1, 0, cols));
  }
  if (bias.has_value()) y.add_(bias.value());
  return y;
}

std::vector<std::string> linear_isas() {
  std::vector<std::string> out;
  for (const auto& entry : tables()) out.push_back(entry.first);
  return out;
}
}  // namespace

namespace conveyor_linear {
at::Tensor plain(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                 const std::string& isa) {
  return plain_linear(x, w, bias, isa);
}

at::Tensor packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  const std::string& isa) {
  return small_linear(x, packed, n, bias, isa);
}

at::Tensor int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                const c10::optional<at::Tensor>& bias, const std::string& isa) {
  return small_linear_i8(x, packed, scale.numel(), scale, bias, isa);
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, const std::string& isa) {
  return linear_i8_tiled(x, packed, scale.numel(), scale, bias, isa);
}

const LinearTable* table_named(const std::string& isa) {
  static const std::vector<std::pair<std::string, const LinearTable*>> all = tables();
  if (isa == "auto") return all.front().second;
  for (const auto& [name, t] : all)
    if (name == isa) return t;
  TORCH_CHECK(false, "linear kernel ISA '", isa, "' is not supported on this CPU (best: ", all.front().first, ")");
}
}  // namespace conveyor_linear

TORCH_LIBRARY(conveyor_linear, m) {
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias, str isa) -> Tensor");
  m.def("linear_i8(Tensor x, Tensor packed, int n, Tensor scale, Tensor? bias, str isa) -> Tensor");
  m.def("linear_plain(Tensor x, Tensor w, Tensor? bias, str isa) -> Tensor");
  m.def("dequant_i8(Tensor packed, int n, Tensor scale) -> Tensor");
  m.def("linear_i8_tiled(Tensor x, Tensor packed, int n, Tensor scale, Tensor? bias, str isa) -> Tensor");
  m.def("supported_isas() -> str[]", &linear_isas);
}

TORCH_LIBRARY_IMPL(conveyor_linear, CPU, m) {
  m.impl("linear", &small_linear);
  m.impl("linear_i8", &small_linear_i8);
  m.impl("linear_plain", &plain_linear);
  m.impl("dequant_i8", &dequant_i8);
  m.impl("linear_i8_tiled", &linear_i8_tiled);
}
