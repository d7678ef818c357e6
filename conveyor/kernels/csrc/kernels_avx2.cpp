// AVX2 + FMA kernels (raised target for this file's own code only, see
// cpu_kernels.h): the vector kernels of simd_kernels.inc 8 floats wide, over
// this file's vocabulary, and the generic loops compiled for AVX2.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {
#include "generic_kernels.inc"

constexpr const char* kIsaName = "avx2";
using Vec = __m256;
using Lanes = __m256i;  // a lane is set when all its bits are
using Cmp = __m256;
constexpr int64_t kW = 8;

inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vfnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2n(Vec p, Vec n) {  // 2^n from its exponent bits
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
                              _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
inline Cmp vlt(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline Vec vselect(Cmp c, Vec set, Vec other) { return _mm256_blendv_ps(other, set, c); }
inline Vec vzero_where(Cmp c, Vec v) { return _mm256_andnot_ps(c, v); }
inline Vec vneg_abs(Vec x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.f)); }

inline float hsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline float hmax(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Lanes [0, left) set (all of them from 8 on).
inline Lanes tail_mask(int64_t left) {
  const int32_t k = left >= 8 ? 8 : static_cast<int32_t>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec vload_tail(Lanes m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void vstore_tail(float* p, Lanes m, Vec v) { _mm256_maskstore_ps(p, m, v); }
inline Vec vzero_unless(Lanes m, Vec v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
inline Vec vmax_tail(Vec acc, Lanes m, const float* p) {
  const Vec ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  return _mm256_max_ps(acc, _mm256_blendv_ps(ninf, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m)));
}

// 8 values of a K/V/query row as fp32 (bf16 by a shift, fp16 by vcvtph2ps:
// both exact).
inline Vec vload_row(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload_row(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vload_row(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A head's K/V row as fp32 in L1 (16 ymm registers cannot hold a 128-wide
// row and the query): a float cache is read in place; bf16/fp16 rows are
// widened once into buf and then used by every query row of the group.
template <typename T, int NV>
struct KvRow {
  const float* p;
  KvRow(const T* src, float* buf) {
    if constexpr (std::is_same<T, float>::value) {
      p = src;
    } else {
      for (int j = 0; j < NV; ++j) _mm256_store_ps(buf + 8 * j, vload_row(src + 8 * j));
      p = buf;
    }
  }
  float dot(const float* qr) const {
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(p));
    __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(qr + 8), _mm256_loadu_ps(p + 8));
    for (int j = 2; j < NV; j += 2) {  // two chains: FMA latency
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), _mm256_loadu_ps(p + 8 * j), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j + 8), _mm256_loadu_ps(p + 8 * j + 8), s1);
    }
    return hsum(_mm256_add_ps(s0, s1));
  }
  void axpy(float weight, float* acc) const {
    const __m256 w = _mm256_set1_ps(weight);
    for (int j = 0; j < NV; ++j)
      _mm256_storeu_ps(acc + 8 * j, _mm256_fmadd_ps(w, _mm256_loadu_ps(p + 8 * j), _mm256_loadu_ps(acc + 8 * j)));
  }
};

constexpr int64_t kMr = 4;  // prefill register block: 4 x 2 accumulators of 16 ymm

#include "simd_kernels.inc"
}  // namespace

#pragma GCC pop_options

namespace conveyor_cpu {
const KernelTable* table_avx2() { return &kSimdTable; }
}  // namespace conveyor_cpu

#else
namespace conveyor_cpu {
const KernelTable* table_avx2() { return nullptr; }
}  // namespace conveyor_cpu
#endif
