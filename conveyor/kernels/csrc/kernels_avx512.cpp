// AVX-512 kernels (raised target for this file's own code only, see
// cpu_kernels.h): the vector kernels of simd_kernels.inc 16 floats wide, over
// this file's vocabulary, and the generic loops compiled for AVX-512.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace {
#include "generic_kernels.inc"

constexpr const char* kIsaName = "avx512";
using Vec = __m512;
using Lanes = __mmask16;
using Cmp = __mmask16;
constexpr int64_t kW = 16;

inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vfnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2n(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
inline Cmp vlt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Vec vselect(Cmp c, Vec set, Vec other) { return _mm512_mask_mov_ps(other, c, set); }
inline Vec vzero_where(Cmp c, Vec v) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~c), v); }
inline Vec vneg_abs(Vec x) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)); }
inline float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float hmax(Vec v) { return _mm512_reduce_max_ps(v); }

inline Lanes tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}
inline Vec vload_tail(Lanes m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_tail(float* p, Lanes m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
inline Vec vzero_unless(Lanes m, Vec v) { return _mm512_maskz_mov_ps(m, v); }
inline Vec vmax_tail(Vec acc, Lanes m, const float* p) {
  return _mm512_mask_max_ps(acc, m, acc, _mm512_maskz_loadu_ps(m, p));
}

// 16 values of a K/V/query row as fp32: bf16 widens by a shift (exact), fp16
// by vcvtph2ps (exact), so every storage dtype runs the same fp32 math.
inline Vec vload_row(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_row(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vload_row(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A head's K/V row held in NV registers (32 zmm: room for a 128-wide row).
template <typename T, int NV>
struct KvRow {
  __m512 r[NV];
  KvRow(const T* src, float*) {
    for (int j = 0; j < NV; ++j) r[j] = vload_row(src + 16 * j);
  }
  float dot(const float* qr) const {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), r[0]);
    for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * j), r[j], acc);
    return _mm512_reduce_add_ps(acc);
  }
  void axpy(float weight, float* acc) const {
    const __m512 w = _mm512_set1_ps(weight);
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + 16 * j, _mm512_fmadd_ps(w, r[j], _mm512_loadu_ps(acc + 16 * j)));
  }
};

constexpr int64_t kMr = 8;  // prefill register block: 8 x 2 accumulators of 32 zmm

#include "simd_kernels.inc"
}  // namespace

#pragma GCC pop_options

namespace conveyor_cpu {
const KernelTable* table_avx512() { return &kSimdTable; }
}  // namespace conveyor_cpu

#else
namespace conveyor_cpu {
const KernelTable* table_avx512() { return nullptr; }
}  // namespace conveyor_cpu
#endif
