// The fused LoRA shrink + expand in AVX2 + FMA (raised target for this file's
// own code only, see cpu_kernels.h): tiles of 2 x 8 columns for 4 rows (8
// sums, 2 B rows and a broadcast stay inside the 16 ymm registers), tails
// through maskload/maskstore.
#include "lora_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {
using conveyor_lora::kRowBlock;
using conveyor_lora::LoraArgs;

struct V {
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr int kWidth = 8;
  static constexpr int kMaxVecs = 2;
  static Mask mask(int64_t left) {
    const int n = left >= 8 ? 8 : (left > 0 ? static_cast<int>(left) : 0);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Reg load(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
  static void store(Mask m, float* p, Reg r) { _mm256_maskstore_ps(p, m, r); }
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float f) { return _mm256_set1_ps(f); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
};

#include "lora_simd.inc"
}  // namespace

#pragma GCC pop_options

namespace conveyor_lora {
LoraRowsFn lora_rows_avx2() { return &lora_rows_simd; }
}  // namespace conveyor_lora

#else
namespace conveyor_lora {
LoraRowsFn lora_rows_avx2() { return nullptr; }
}  // namespace conveyor_lora
#endif
