// Small-M linears as plain loops for the baseline ISA (any CPU), over the same
// packed layout and in the same k order per column as the vector paths.
#include <cstring>

#include "linear_kernels.h"

namespace {
using conveyor_linear::kBlockN;
using conveyor_linear::LinearArgs;

// bf16 bits -> fp32 (exact: bf16 is fp32's upper half).
inline float widen(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

enum class W { kF32, kBf16, kI8 };

// Weight (k, column c) of block nb.
template <W kW>
inline float weight(const LinearArgs& a, int64_t nb, int64_t k, int64_t c) {
  if constexpr (kW == W::kBf16) {
    const uint32_t pair = static_cast<const uint32_t*>(a.w)[(nb * a.k + k) / 2 * kBlockN + c];
    return widen(k % 2 ? pair >> 16 : pair & 0xFFFFu);
  } else if constexpr (kW == W::kI8) {
    return static_cast<float>(static_cast<const int8_t*>(a.w)[(nb * a.k + k) * kBlockN + c]);
  } else {
    return static_cast<const float*>(a.w)[(nb * a.k + k) * kBlockN + c];
  }
}

template <W kW>
void blocks(const LinearArgs& a, int64_t lo, int64_t hi) {
  const float* x = static_cast<const float*>(a.x);
  for (int64_t nb = lo; nb < hi; ++nb)
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t c = 0; c < kBlockN; ++c) {
        float s = 0.f;
        for (int64_t k = 0; k < a.k; ++k) s += x[i * a.xm + k * a.xk] * weight<kW>(a, nb, k, c);
        const int64_t col = nb * kBlockN + c;
        const float out = (a.scale ? s * a.scale[col] : s) + (a.bias ? a.bias[col] : 0.f);
        if (a.yb)
          a.yb[i * a.np + col] = conveyor_linear::round_bf16(out);
        else
          a.y[i * a.np + col] = out;
      }
}

// Plain [n][k] fp32 weights: each sum in k order.
void plain(const conveyor_linear::PlainArgs& a, int64_t lo, int64_t hi) {
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.w);
  for (int64_t n = lo; n < hi; ++n)
    for (int64_t i = 0; i < a.m; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < a.k; ++k) s += x[i * a.ldx + k] * w[n * a.ldw + k];
      a.y[i * a.ldy + n] = a.bias ? s + a.bias[n] : s;
    }
}
}  // namespace

namespace conveyor_linear {
const LinearTable* linear_portable() {
  static const LinearTable t{"portable", &blocks<W::kF32>, &blocks<W::kBf16>, nullptr, &blocks<W::kI8>, &plain, nullptr};
  return &t;
}
}  // namespace conveyor_linear
