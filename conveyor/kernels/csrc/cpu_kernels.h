// The CPU kernels' shared types and the per-ISA kernel tables.
//
// One build serves every x86 machine: kernels_portable.cpp is compiled for the
// baseline ISA, kernels_avx2.cpp and kernels_avx512.cpp raise the target with
// `#pragma GCC target` for their own code only, and the glue
// (paged_attention_cpu.cpp) picks a table by cpuid at load (or as told by
// set_isa). Nothing here may have external linkage and inline code compiled
// under a raised target: the linker would keep one copy of it for every
// caller, also on a CPU without that ISA. So the ISA files keep their code in
// an anonymous namespace and allocate nothing (scratch comes from the glue).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace conveyor_cpu {

struct Shape {
  int64_t block_size, hkv, dim, group, max_blocks;
  int64_t q_tok_stride, q_head_stride;  // query / out strides, elements
};

// What every request of one paged_attention_short call shares.
template <typename T>
struct AttnBatch {
  const T* query;
  const T* cache;  // [num_blocks, 2, block_size, Hkv, D]
  T* out;
  float scale;
  Shape s;
};

// One request: its block-table row, first query token, query and sequence length.
// part != nullptr: this is one slice of a split request's keys (split-KV
// decode); the kernel writes its rows' normalized fp32 outputs [rows, D] and
// then their log-sum-exps [rows] there instead of into out (see store_part).
struct Req {
  const int32_t* blocks;
  int64_t start, q_len, seq_len;
  float* part = nullptr;
};

// Floats of scratch one request needs: scaled queries, accumulators, scores,
// denominators, row maxima.
inline int64_t scratch_floats(const Shape& s, const Req& r) {
  const int64_t rows = r.q_len * s.hkv * s.group;
  return rows * (2 * s.dim + r.seq_len + 2);
}

template <typename T>
using AttendFn = void (*)(const AttnBatch<T>&, const Req&, float* scratch);

// Neox rotary over rows [lo, hi) of fp32 query and key (see rotary_neox).
struct RotaryArgs {
  const int64_t* pos;
  const float* table;  // [P, rd]: cos half then sin half
  int64_t rd, head_size;
  float* x[2];
  int64_t stride[2], heads[2];
};
using RotaryRowsFn = void (*)(const RotaryArgs&, int64_t lo, int64_t hi);

// RMSNorm over rows [lo, hi) of a [T, h] tensor (see rms_norm).
template <typename T>
struct RmsArgs {
  const T* in;
  const T* weight;
  T* out;
  int64_t h;
  float eps;
};
template <typename T>
using RmsRowsFn = void (*)(const RmsArgs<T>&, int64_t lo, int64_t hi);

// silu(gate) * up over rows [lo, hi) of fp32 x [T, 2d] = [gate | up] -> out [T, d].
struct SiluMulArgs {
  const float* x;
  float* out;
  int64_t d;
};
using SiluMulRowsFn = void (*)(const SiluMulArgs&, int64_t lo, int64_t hi);

// One long query chunk of one request (prefill): query/out [T, Hq, D]
// (strides in s), keys 0..seq_len-1 through `blocks`; query token i sits at
// position seq_len - q_len + i and sees keys 0..that position. query, cache
// and out hold the dtype of the kernel they are passed to (fp32 or bf16).
struct PrefillArgs {
  const void* query;
  const void* cache;
  void* out;
  const int32_t* blocks;
  float scale;
  Shape s;
  int64_t start, q_len, seq_len;
};
// One task: kv head `kv_head` (its whole query group), query tokens [q0, q0 + KernelTable::prefill_rows).
using PrefillFn = void (*)(const PrefillArgs&, int64_t kv_head, int64_t q0, float* scratch);

struct KernelTable {
  const char* name;
  AttendFn<float> (*attend_f32)(int64_t dim);  // the fastest fp32 kernel for this head size
  AttendFn<c10::Half> attend_f16;
  AttendFn<c10::BFloat16> attend_bf16;
  RotaryRowsFn rotary;
  RmsRowsFn<float> rms_f32;
  RmsRowsFn<c10::Half> rms_f16;
  RmsRowsFn<c10::BFloat16> rms_bf16;
  SiluMulRowsFn silu_mul;
  PrefillFn (*prefill_f32)(int64_t dim);   // nullptr: no prefill kernel for this head size (SDPA runs)
  PrefillFn (*prefill_bf16)(int64_t dim);  // the same over bf16 query/cache/out (fp32 math)
  int64_t prefill_rows;                   // query tokens per prefill task
  // Floats of scratch one prefill task needs at most (the kernel's own layout).
  int64_t (*prefill_scratch)(int64_t dim, int64_t group);
};

const KernelTable* table_portable();
const KernelTable* table_avx2();    // nullptr off x86
const KernelTable* table_avx512();  // nullptr off x86

// Whether this CPU runs code built for `isa` ("avx512": avx512f; "avx512bf16":
// avx512f and avx512bf16; "avx2": avx2, fma and f16c; "portable": always), by cpuid and the OS saving the wider
// registers (GCC's __builtin_cpu_supports checks both). Every kernel family
// (attention tables, multi-LoRA, small-M linears) picks its tables by this one check.
bool cpu_runs(const char* isa);

}  // namespace conveyor_cpu
