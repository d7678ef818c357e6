// The fused LoRA shrink + expand in AVX-512 (raised target for this file's own
// code only, see cpu_kernels.h): tiles of 4 x 16 columns for 4 rows, 16 sums
// in registers, masked tails.
#include "lora_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace {
using conveyor_lora::kRowBlock;
using conveyor_lora::LoraArgs;

struct V {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int kWidth = 16;
  static constexpr int kMaxVecs = 4;
  static Mask mask(int64_t left) {
    return left >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << (left > 0 ? left : 0)) - 1u);
  }
  static Reg load(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(Mask m, float* p, Reg r) { _mm512_mask_storeu_ps(p, m, r); }
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float f) { return _mm512_set1_ps(f); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "lora_simd.inc"
}  // namespace

#pragma GCC pop_options

namespace conveyor_lora {
LoraRowsFn lora_rows_avx512() { return &lora_rows_simd; }
}  // namespace conveyor_lora

#else
namespace conveyor_lora {
LoraRowsFn lora_rows_avx512() { return nullptr; }
}  // namespace conveyor_lora
#endif
