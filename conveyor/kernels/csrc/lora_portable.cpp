// The fused LoRA shrink + expand as plain loops for the baseline ISA (any CPU):
// the same row blocks and order of sums as the vector paths.
#include "lora_kernels.h"

namespace {
using conveyor_lora::kRowBlock;
using conveyor_lora::LoraArgs;

void lora_block(const LoraArgs& p, const int64_t* rows, int mb, float* s) {
  for (int64_t c = 0; c < mb * p.nr; ++c) s[c] = 0.f;
  for (int i = 0; i < mb; ++i) {
    const float* x = p.x + rows[i] * p.x_stride;
    float* si = s + i * p.nr;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const float xv = x[kk];
      const float* a = p.a + kk * p.nr;
      for (int64_t c = 0; c < p.nr; ++c) si[c] += xv * a[c];
    }
  }
  for (int sub = 0; sub < p.n_sub; ++sub) {
    const int64_t n = p.n[sub];
    for (int i = 0; i < mb; ++i) {
      float* y = p.y + rows[i] * p.y_stride + p.off[sub];
      const float* si = s + i * p.nr + sub * p.rank;
      for (int64_t r = 0; r < p.rank; ++r) {
        const float sv = si[r];
        const float* b = p.b[sub] + r * n;
        for (int64_t c = 0; c < n; ++c) y[c] += sv * b[c];
      }
    }
  }
}

void lora_rows_portable_impl(const LoraArgs& p, const int64_t* rows, int64_t count, float* scratch) {
  for (int64_t j = 0; j < count; j += kRowBlock) {
    const int64_t mb = count - j < kRowBlock ? count - j : kRowBlock;
    lora_block(p, rows + j, static_cast<int>(mb), scratch);
  }
}
}  // namespace

namespace conveyor_lora {
LoraRowsFn lora_rows_portable() { return &lora_rows_portable_impl; }
}  // namespace conveyor_lora
