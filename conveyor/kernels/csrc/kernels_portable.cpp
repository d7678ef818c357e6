// The portable kernels: the plain C++ loops compiled for the baseline ISA
// (whatever the build's flags give: SSE2 on x86-64, NEON on aarch64).
#include "cpu_kernels.h"

#include <cmath>
#include <limits>

namespace {
#include "generic_kernels.inc"

conveyor_cpu::AttendFn<float> attend_f32(int64_t) { return &attend_generic<float>; }
conveyor_cpu::PrefillFn no_prefill(int64_t) { return nullptr; }  // prefill runs on SDPA
int64_t no_scratch(int64_t, int64_t) { return 0; }
}  // namespace

namespace conveyor_cpu {

const KernelTable* table_portable() {
  static const KernelTable t{"portable", &attend_f32, &attend_generic<c10::Half>,
                             &attend_generic<c10::BFloat16>, &rotary_rows_generic, &rms_rows<float>,
                             &rms_rows<c10::Half>, &rms_rows<c10::BFloat16>,
                             &silu_mul_rows_generic, &no_prefill, &no_prefill, 0,
                             &no_scratch};
  return &t;
}

}  // namespace conveyor_cpu
