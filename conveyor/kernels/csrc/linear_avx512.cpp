// Small-M linears in AVX-512 (raised target for this file's own code only, see
// cpu_kernels.h): a packed block's 16 columns are one zmm, up to 16 rows' sums
// stay in registers. A second region adds AVX512_BF16 for bf16 weights:
// vdpbf16ps multiplies a pair of k per lane, products exact, summed into fp32
// (the glue checks cpuid before choosing that table).
#include "linear_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <array>
#include <utility>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace {
#include "bf16_avx512.inc"

struct V {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kMaxRows = 16;
  static constexpr int kMaxRowsWide = 16;
  // fp32 passes over two blocks (linear_simd.inc): 24 sums, two weight
  // registers and x in 32 zmm. Weights from DRAM (Xeon, 2 threads, K 1024,
  // 256 MB), GB/s one block -> two: 4 rows 21.9 -> 25.3, 8 rows 20.3 -> 24.5,
  // 12 rows 18.8 -> 23.2, 16 rows 17.3 -> 17.0, 20 rows 13.5 -> 16.2,
  // 32 rows 10.6 -> 12.5.
  static constexpr int kPairRowsF32 = 12;
  // Plain weights (linear_plain.inc): tiles of up to 24 sums (1-4 rows x 6
  // columns), 6 weight vectors and x.
  static constexpr int kDotCols = 6;
  static constexpr int kDotSums = 24;
  static float hsum(Reg r) { return _mm512_reduce_add_ps(r); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg r) { _mm512_storeu_ps(p, r); }
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float f) { return _mm512_set1_ps(f); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg widen_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_bf16(uint16_t* p, Reg r) { store_bf16x16(p, r); }
  static void widen_pairs(const uint32_t* p, Reg& even, Reg& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

#include "linear_simd.inc"
#include "linear_plain.inc"

constexpr conveyor_linear::LinearFn kF32 = &linear_blocks<F32>;
constexpr conveyor_linear::LinearFn kBf16Wide = &linear_blocks<Bf16Wide>;
#include "i8_gemm_avx512.inc"

constexpr conveyor_linear::LinearFn kI8 = &linear_blocks<I8>;
const conveyor_linear::LinearTable kTable{"avx512", kF32, kBf16Wide, nullptr, kI8, &plain_columns<F32Dot>, nullptr,
                                          &i8gemm::gemm};
}  // namespace

#pragma GCC pop_options

#if defined(__GNUC__) && __GNUC__ >= 10
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,avx2,fma")

namespace {
namespace dot {
// bf16 weights and x: rows [m0, m0 + MB) of block nb over k in [k0, k1) (k0,
// k1 even). Each uint32 of x holds one row's (k, k + 1) bf16 pair, broadcast
// to all lanes; vdpbf16ps adds both exact products to the lane's fp32 sum.
template <int MB>
void bf16_dot_rows(const LinearArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1) {
  __m512 acc[MB][kNv];
  float* y = a.y + m0 * a.np + nb * kBlockN;
  load_sums<MB>(a, y, k0, acc);
  const uint32_t* w = static_cast<const uint32_t*>(a.w) + (nb * a.k + k0) / 2 * kBlockN;
  const uint32_t* x = static_cast<const uint32_t*>(a.x) + k0 / 2 * a.xk + m0 * a.xm;
  const int64_t xm = a.xm;
  for (int64_t k = k0; k < k1; k += 2, w += kBlockN, x += a.xk) {
    __builtin_prefetch(w + kAhead<MB>);
    const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    for (int i = 0; i < MB; ++i)
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[i * xm]))),
                                   wv);
  }
  store_sums<MB>(a, nb, m0, k1, acc);
}

template <int MB>
struct Bf16Dot {
  static constexpr RowsFn fn = &bf16_dot_rows<MB>;
  static constexpr int kRows = V::kMaxRows;
  static constexpr int kPairRows = 0;
  static constexpr int64_t kChunk = kChunkK;
};

// bf16 weights as they are ([n][k]) and bf16 x, all MB rows by columns
// [n0, n0 + J): per 32 k, vdpbf16ps adds each lane's two exact products to its
// fp32 sum (linear_plain.inc's tiles otherwise: lanes summed, then the odd k
// past the last whole vector, then the bias, rounded once to bf16).
template <int MB, int J>
void bf16_plain_tile(const PlainArgs& a, int64_t n0) {
  __m512 acc[MB][J];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n0 * a.ldw;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const int64_t kv = a.k / 32 * 32;
  for (int64_t k = 0; k < kv; k += 32) {
    __m512bh wv[J];
    for (int j = 0; j < J; ++j) {
      __builtin_prefetch(w + (j + J) * a.ldw + k);
      wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * a.ldw + k));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i * a.ldx + k));
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < J; ++j) {
      float s = _mm512_reduce_add_ps(acc[i][j]);
      for (int64_t k = kv; k < a.k; ++k) s += widen_bf16(x[i * a.ldx + k]) * widen_bf16(w[j * a.ldw + k]);
      a.yb[i * a.ldy + n0 + j] = conveyor_linear::round_bf16(a.bias ? s + a.bias[n0 + j] : s);
    }
}

template <int MB, int J>
struct Bf16Plain {
  static constexpr DotTileFn fn = &bf16_plain_tile<MB, J>;
};
}  // namespace dot

const conveyor_linear::LinearTable kTableBf16{"avx512bf16", kF32, kBf16Wide, &linear_blocks<dot::Bf16Dot>, kI8,
                                             &plain_columns<F32Dot>, &plain_columns<dot::Bf16Plain>,
                                             &i8gemm::gemm};
}  // namespace

#pragma GCC pop_options
#define CONVEYOR_LINEAR_AVX512BF16 1
#endif

namespace conveyor_linear {
const LinearTable* linear_avx512() { return &kTable; }
#ifdef CONVEYOR_LINEAR_AVX512BF16
const LinearTable* linear_avx512bf16() { return &kTableBf16; }
#else
const LinearTable* linear_avx512bf16() { return nullptr; }
#endif
}  // namespace conveyor_linear

#else
namespace conveyor_linear {
const LinearTable* linear_avx512() { return nullptr; }
const LinearTable* linear_avx512bf16() { return nullptr; }
}  // namespace conveyor_linear
#endif
