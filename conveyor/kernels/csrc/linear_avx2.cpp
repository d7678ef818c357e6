// Small-M linears in AVX2 + FMA (raised target for this file's own code only,
// see cpu_kernels.h): a packed block's 16 columns are two ymm. fp32 and int8
// keep 6 rows' sums (12 registers) in the 16 ymm with the block's 2 weight
// vectors and a broadcast; bf16 weights are widened in registers (fp32 math)
// into 4 vectors plus 2 broadcasts, so 5 rows (6 spilled: 16 rows ran ~10%
// slower). 6 rows against 5 ran fp32 16 rows 1.20x oneDNN's AVX2 GEMM, was
// 1.06x (BENCHMARKS.md, "AVX2 row block").
#include "linear_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <array>
#include <utility>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {
struct V {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxRowsWide = 5;
  static constexpr int kPairRowsF32 = 0;  // two 8-wide registers a block already
  // Plain weights (linear_plain.inc): tiles of up to 12 sums (1-3 rows x 4
  // columns, 4 x 3), their weight vectors and x.
  static constexpr int kDotCols = 4;
  static constexpr int kDotSums = 12;
  static float hsum(Reg r) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg r) { _mm256_storeu_ps(p, r); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float f) { return _mm256_set1_ps(f); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg widen_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_bf16(uint16_t* p, Reg r) {
    const __m256i u = _mm256_castps_si256(r);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i b = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), nan);
    // Each value fits 16 bits: the unsigned-saturating pack keeps it.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  static void widen_pairs(const uint32_t* p, Reg& even, Reg& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

#include "linear_simd.inc"
#include "linear_plain.inc"

const conveyor_linear::LinearTable kTable{"avx2", &linear_blocks<F32>, &linear_blocks<Bf16Wide>, nullptr,
                                          &linear_blocks<I8>, &plain_columns<F32Dot>, nullptr};
}  // namespace

#pragma GCC pop_options

namespace conveyor_linear {
const LinearTable* linear_avx2() { return &kTable; }
}  // namespace conveyor_linear

#else
namespace conveyor_linear {
const LinearTable* linear_avx2() { return nullptr; }
}  // namespace conveyor_linear
#endif
