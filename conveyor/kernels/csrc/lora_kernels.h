// Multi-LoRA on CPU: one adapter slot's shrink and expand, fused, over a list
// of token rows, adding into y in place (see lora_cpu.cpp for the op).
//
// Built into the same extension as the attention kernels (cpu_kernels.h's
// rules hold: each ISA file raises its own target and keeps its code in an
// anonymous namespace; scratch comes from the glue). No torch headers here,
// so the ISA files compile in a second or two.
#pragma once

#include <cstdint>

namespace conveyor_lora {

constexpr int kMaxSubs = 3;   // q/k/v: the most sub-projections one linear fuses
constexpr int kRowBlock = 4;  // rows shrunk and expanded together (registers hold their sums)

// One slot of one LoRA-wrapped linear. Sub-projection i reads shrunk columns
// [i * rank, (i + 1) * rank) and adds into y columns [off[i], off[i] + n[i]).
struct LoraArgs {
  const float* x;  // [T, k], row stride x_stride, columns contiguous
  float* y;        // [T, *], row stride y_stride, columns contiguous
  int64_t x_stride, y_stride;
  const float* a;  // this slot's A^T: [k, nr] contiguous, nr = n_sub * rank
  int64_t k, nr, rank;
  int n_sub;
  const float* b[kMaxSubs];  // this slot's B_i^T * scale: [rank, n[i]] contiguous
  int64_t n[kMaxSubs], off[kMaxSubs];
};

// y[rows[j]] += (x[rows[j]] @ a)[sub i] @ b[i] for j < count, every sub i.
// scratch: kRowBlock * nr floats.
using LoraRowsFn = void (*)(const LoraArgs&, const int64_t* rows, int64_t count, float* scratch);

LoraRowsFn lora_rows_portable();
LoraRowsFn lora_rows_avx2();    // nullptr off x86
LoraRowsFn lora_rows_avx512();  // nullptr off x86

}  // namespace conveyor_lora
