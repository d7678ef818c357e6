// The CPU extension's torch ops: paged attention for short queries (decode
// rows, speculative drafts), write_kv, fused residual + RMSNorm, neox rotary.
// The kernels themselves live in kernels_{portable,avx2,avx512}.cpp, one
// table each, chosen here by cpuid at load (set_isa overrides it).
//
// Reads K/V in place from the paged cache [num_blocks, 2, block_size, Hkv, D]
// through the block table: no gathered copy, no padding, no mask tensor.
// One task per request, or per slice of a long decode row's keys when few
// requests would idle a thread (split-KV); dynamic OpenMP schedule over torch's
// thread count. Math is fp32 whatever the storage dtype.
//
// Query token i of request b sits at position seq_len - q_len + i and sees keys
// 0..that position (causal within the drafts).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_ops.h"

namespace conveyor_cpu {
bool cpu_runs(const char* isa) {
  const std::string name(isa);
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (name == "avx512") return __builtin_cpu_supports("avx512f");
  if (name == "avx512bf16") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (name == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return name == "portable";
}
}  // namespace conveyor_cpu

namespace {

using conveyor_cpu::KernelTable;

// Every table this CPU can run, best first (conveyor_cpu::cpu_runs); the
// portable one runs anywhere.
std::vector<const KernelTable*> supported_tables() {
  std::vector<const KernelTable*> out;
  if (conveyor_cpu::cpu_runs("avx512") && conveyor_cpu::table_avx512()) out.push_back(conveyor_cpu::table_avx512());
  if (conveyor_cpu::cpu_runs("avx2") && conveyor_cpu::table_avx2()) out.push_back(conveyor_cpu::table_avx2());
  out.push_back(conveyor_cpu::table_portable());
  return out;
}

// The table in use: the best supported one until set_isa says otherwise.
std::atomic<const KernelTable*> g_active{nullptr};

const KernelTable& active() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = supported_tables().front();
    g_active.store(t, std::memory_order_release);
  }
  return *t;
}

template <typename T>
conveyor_cpu::AttendFn<T> attend_fn(const KernelTable& k, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) return k.attend_f32(dim);
  else if constexpr (std::is_same_v<T, c10::Half>) return k.attend_f16;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return k.attend_bf16;
  else return nullptr;  // fp64: never reached (query dtype is checked)
}

template <typename T>
conveyor_cpu::RmsRowsFn<T> rms_fn(const KernelTable& k) {
  if constexpr (std::is_same_v<T, float>) return k.rms_f32;
  else if constexpr (std::is_same_v<T, c10::Half>) return k.rms_f16;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return k.rms_bf16;
  else return nullptr;
}

using conveyor_cpu::Req;

constexpr int64_t kMaxSplitDim = 512;  // head sizes past this are never split (merge's stack row)

// Split-KV for decode rows: one task per request leaves a thread idle when a
// few long requests make the batch (batch 1 at 8k context read its 128 MB of
// K/V per step on one of two cores). A decode row longer than part_len
// (rounded up to whole blocks) becomes slices of its keys, each a task that
// writes its normalized output and log-sum-exp into `parts`; merge_parts
// then weighs them. Draft rows (q_len > 1) are never split.
struct Plan {
  std::vector<Req> tasks;
  std::vector<int64_t> split_first;  // per split request: its first task
  std::vector<int64_t> split_count;  // per split request: how many slices
  std::vector<float> parts;
};

Plan plan_tasks(const conveyor_cpu::Shape& s, const int32_t* bt, const int64_t* const idx[4], int64_t n,
                int64_t part_len) {
  Plan p;
  const int64_t bs = s.block_size, rows = s.hkv * s.group;
  part_len = part_len > 0 && s.dim <= kMaxSplitDim ? (part_len + bs - 1) / bs * bs : 0;
  auto is_split = [&](int64_t b) { return part_len > 0 && idx[2][b] == 1 && idx[3][b] > part_len; };
  int64_t floats = 0;
  for (int64_t b = 0; b < n; ++b)
    if (is_split(b)) floats += (idx[3][b] + part_len - 1) / part_len * rows * (s.dim + 1);
  p.parts.resize(static_cast<size_t>(floats));
  float* buf = p.parts.data();
  for (int64_t b = 0; b < n; ++b) {
    const Req rq{bt + idx[0][b] * s.max_blocks, idx[1][b], idx[2][b], idx[3][b]};
    if (!is_split(b)) {
      p.tasks.push_back(rq);
      continue;
    }
    p.split_first.push_back(static_cast<int64_t>(p.tasks.size()));
    p.split_count.push_back((rq.seq_len + part_len - 1) / part_len);
    for (int64_t lo = 0; lo < rq.seq_len; lo += part_len, buf += rows * (s.dim + 1))
      p.tasks.push_back(Req{rq.blocks + lo / bs, rq.start, 1, std::min(part_len, rq.seq_len - lo), buf});
  }
  return p;
}

// out row = sum_j w_j o_j / sum_j w_j over a split request's slices, w_j = exp(lse_j - max lse).
template <typename T>
void merge_parts(const conveyor_cpu::AttnBatch<T>& a, const Plan& p) {
  const int64_t rows = a.s.hkv * a.s.group, d = a.s.dim;
  for (size_t i = 0; i < p.split_first.size(); ++i) {
    const int64_t first = p.split_first[i], end = first + p.split_count[i];
    for (int64_t r = 0; r < rows; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = first; t < end; ++t) mx = std::max(mx, p.tasks[t].part[rows * d + r]);
      float acc[kMaxSplitDim] = {0.f};
      float wsum = 0.f;
      for (int64_t t = first; t < end; ++t) {
        const float w = std::exp(p.tasks[t].part[rows * d + r] - mx);
        wsum += w;
        for (int64_t x = 0; x < d; ++x) acc[x] += w * p.tasks[t].part[r * d + x];
      }
      T* dst = a.out + p.tasks[first].start * a.s.q_tok_stride + r * a.s.q_head_stride;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(acc[x] / wsum);
    }
  }
}

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
         const int64_t* const idx[4], int64_t n, double scale, int64_t part_len, torch::Tensor& out) {
  const conveyor_cpu::AttnBatch<T> a{
      query.data_ptr<T>(), kv_cache.data_ptr<T>(), out.data_ptr<T>(), static_cast<float>(scale),
      conveyor_cpu::Shape{kv_cache.size(2), kv_cache.size(3), kv_cache.size(4),
                          query.size(1) / kv_cache.size(3), block_table.size(1), query.stride(0),
                          query.stride(1)}};
  const conveyor_cpu::AttendFn<T> attend = attend_fn<T>(active(), a.s.dim);
  const Plan plan = plan_tasks(a.s, block_table.data_ptr<int32_t>(), idx, n, part_len);
  const int64_t num_tasks = static_cast<int64_t>(plan.tasks.size());
  // Dynamic schedule: request lengths differ a lot, a static split would idle a core.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < num_tasks; ++t) {
    thread_local std::vector<float> scratch;  // per thread, no allocation per request
    scratch.resize(static_cast<size_t>(conveyor_cpu::scratch_floats(a.s, plan.tasks[t])));
    attend(a, plan.tasks[t], scratch.data());
  }
  merge_parts(a, plan);
}

}  // namespace

// query/out [T, Hq, D] (head dim contiguous), kv_cache contiguous, block_table
// int32 [R, M]; reqs/starts/q_lens/seq_lens int64 [n] on CPU. Writes only the
// rows of the n requests. part_len > 0: decode rows longer than that many
// keys are split across tasks (split-KV, see plan_tasks); 0: never.
void paged_attention_short(const torch::Tensor& query, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_table, const torch::Tensor& reqs,
                           const torch::Tensor& starts, const torch::Tensor& q_lens,
                           const torch::Tensor& seq_lens, double scale, torch::Tensor out,
                           int64_t part_len) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, Hq, D], D contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.strides() == query.strides(), "out must match query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-d");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache and query dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous(), "block_table int32");
  TORCH_CHECK(query.scalar_type() != torch::kFloat64, "fp32, fp16 or bf16 only");
  const int64_t* const idx[4] = {reqs.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                                 q_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, query.scalar_type(),
                                  "paged_attention_short", [&] {
    run<scalar_t>(query, kv_cache, block_table, idx, reqs.numel(), scale, part_len, out);
  });
}

// One request's long query chunk (prefill), fp32 or bf16 (fp32 math):
// query/out [T, Hq, D] (D contiguous), blocks int32 [>= ceil(seq_len /
// block_size)], the chunk's tokens [start, start + q_len) at positions
// seq_len - q_len + i. Returns false (nothing written) when the active table
// has no prefill kernel for this head size or dtype: the caller runs SDPA.
// Tasks (kv head x prefill_rows tokens) go longest first over torch's
// threads: later tokens see more keys.
bool paged_prefill(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& blocks,
                   int64_t start, int64_t q_len, int64_t seq_len, double scale, torch::Tensor out) {
  const KernelTable& k = active();
  const auto dt = query.scalar_type();
  const bool same = kv_cache.scalar_type() == dt && out.scalar_type() == dt && kv_cache.dim() == 5;
  const conveyor_cpu::PrefillFn fn = !same ? nullptr
      : dt == torch::kFloat32 ? k.prefill_f32(kv_cache.size(4))
      : dt == torch::kBFloat16 ? k.prefill_bf16(kv_cache.size(4)) : nullptr;
  if (fn == nullptr) return false;
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.strides() == query.strides(),
              "query/out [T, Hq, D], D contiguous, same strides");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache contiguous");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt32 && blocks.is_contiguous() &&
              blocks.numel() * kv_cache.size(2) >= seq_len, "blocks int32 covering seq_len");
  TORCH_CHECK(q_len > 0 && q_len <= seq_len && start + q_len <= query.size(0), "query rows out of range");
  const conveyor_cpu::PrefillArgs a{
      query.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), blocks.data_ptr<int32_t>(),
      static_cast<float>(scale),
      conveyor_cpu::Shape{kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), query.size(1) / kv_cache.size(3),
                          blocks.numel(), query.stride(0), query.stride(1)},
      start, q_len, seq_len};
  const int64_t rows = k.prefill_rows, nblk = (q_len + rows - 1) / rows, heads = a.s.hkv;
  const int64_t floats = k.prefill_scratch(a.s.dim, a.s.group);
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < nblk * heads; ++t) {
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(floats));
    fn(a, t % heads, (nblk - 1 - t / heads) * rows, scratch.data());
  }
  return true;
}

// cache[s / bs, 0|1, s % bs] = key|value[t] for every slot s = slot_mapping[t] >= 0.
// key/value [T, Hkv, D] with each token's heads contiguous (a row may be strided).
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor cache,
              const torch::Tensor& slot_mapping) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5, "kv_cache must be contiguous 5-d");
  TORCH_CHECK(key.scalar_type() == cache.scalar_type() && value.scalar_type() == cache.scalar_type(),
              "key/value dtype must match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping int64");
  const int64_t bs = cache.size(2), row = cache.size(3) * cache.size(4);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == cache.size(4) && value.stride(2) == 1 &&
              value.stride(1) == cache.size(4), "key/value heads must be contiguous per token");
  const int64_t n = slot_mapping.numel();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, cache.scalar_type(),
                                  "write_kv", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    scalar_t* c = cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      scalar_t* dst = c + ((s / bs) * 2 * bs + s % bs) * row;
      std::memcpy(dst, k + t * ks, row * sizeof(scalar_t));
      std::memcpy(dst + bs * row, v + t * vs, row * sizeof(scalar_t));
    }
  });
}

// (norm(x + residual) * weight, x + residual) or, without residual,
// (norm(x) * weight, x): x / sqrt(mean(x^2) + eps) in fp32, cast back to the
// model dtype before the weight multiplies (as the torch RMSNorm does).
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                    const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "x [T, H] contiguous");
  const int64_t t = x.size(0), h = x.size(1);
  torch::Tensor sum = residual.has_value() ? x + residual.value() : x;
  torch::Tensor out = torch::empty_like(x);
  TORCH_CHECK(x.scalar_type() != torch::kFloat64, "fp32, fp16 or bf16 only");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
                                  "rms_norm", [&] {
    const conveyor_cpu::RmsArgs<scalar_t> a{sum.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                            out.data_ptr<scalar_t>(), h, static_cast<float>(eps)};
    const conveyor_cpu::RmsRowsFn<scalar_t> rows = rms_fn<scalar_t>(active());
    at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) { rows(a, lo, hi); });
  });
  return {out, sum};
}


// bf16 rows go through the tables' fp32 row kernels: widened into scratch,
// computed in fp32, rounded back once to nearest even (as vLLM's CPU kernels
// round; the torch bf16 forms round after every op). Compiled for the
// baseline ISA: -O3 vectorizes both loops.
static void widen_bf16(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &u, 4);
  }
}

static void round_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7fc0u : rounded);  // NaN stays NaN
  }
}

// Rotary rows [lo, hi) of bf16 q/k (a's x/stride describe the bf16 tensors),
// kBf16Rows rows at a time, so the fp32 scratch stays in L2 whatever the
// chunk (a thread's whole share of a 2048-token prefill is ~10 MB).
constexpr int64_t kBf16Rows = 8;

static void rotary_rows_bf16(const conveyor_cpu::RotaryArgs& a, int64_t lo, int64_t hi,
                             conveyor_cpu::RotaryRowsFn rows) {
  const int64_t w[2] = {a.heads[0] * a.head_size, a.heads[1] * a.head_size};
  std::vector<float> buf(static_cast<size_t>(std::min(hi - lo, kBf16Rows) * (w[0] + w[1])));
  for (int64_t r0 = lo; r0 < hi; r0 += kBf16Rows) {
    const int64_t n = std::min(hi - r0, kBf16Rows);
    float* f[2] = {buf.data(), buf.data() + n * w[0]};
    for (int x = 0; x < 2; ++x)
      for (int64_t r = 0; r < n; ++r)
        widen_bf16(reinterpret_cast<const c10::BFloat16*>(a.x[x]) + (r0 + r) * a.stride[x], f[x] + r * w[x], w[x]);
    const conveyor_cpu::RotaryArgs fa{a.pos + r0, a.table, a.rd, a.head_size, {f[0], f[1]}, {w[0], w[1]},
                                      {a.heads[0], a.heads[1]}};
    rows(fa, 0, n);
    for (int x = 0; x < 2; ++x)
      for (int64_t r = 0; r < n; ++r)
        round_bf16(f[x] + r * w[x], reinterpret_cast<c10::BFloat16*>(a.x[x]) + (r0 + r) * a.stride[x], w[x]);
  }
}

// Neox rotary embedding in place on fp32 or bf16 query [T, Hq*D] and key
// [T, Hkv*D] (each row's heads contiguous; rows may be strided views of the
// qkv output): the first rd = cos_sin.size(1) dims of each head, (x1, x2) ->
// (x1 c - x2 s, x2 c + x1 s), c|s = cos_sin[position]. Built with
// -ffp-contract=off, so each fp32 product is rounded as the torch form rounds it.
void rotary_neox(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                 const torch::Tensor& cos_sin, int64_t head_size) {
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.dim() == 1,
              "positions int64 [T]");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 2,
              "cos_sin fp32 [P, rd]");
  const int64_t t = positions.numel(), rd = cos_sin.size(1), max_pos = cos_sin.size(0);
  TORCH_CHECK(rd % 2 == 0 && rd <= head_size, "rotary dim must be even and at most the head size");
  const bool bf16 = query.scalar_type() == torch::kBFloat16;
  for (const torch::Tensor* x : {&query, &key}) {
    TORCH_CHECK((x->scalar_type() == torch::kFloat32 || x->scalar_type() == torch::kBFloat16) &&
                x->scalar_type() == query.scalar_type() && x->dim() == 2 && x->size(0) == t &&
                x->stride(1) == 1 && x->size(1) % head_size == 0,
                "query/key fp32 or bf16 (both the same) [T, H*D], D contiguous");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position out of range");
  const conveyor_cpu::RotaryArgs a{
      pos, cos_sin.data_ptr<float>(), rd, head_size,
      {static_cast<float*>(query.data_ptr()), static_cast<float*>(key.data_ptr())},
      {query.stride(0), key.stride(0)}, {query.size(1) / head_size, key.size(1) / head_size}};
  const conveyor_cpu::RotaryRowsFn rows = active().rotary;
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    if (bf16) rotary_rows_bf16(a, lo, hi, rows);
    else rows(a, lo, hi);
  });
}

// bf16 silu(gate) * up over rows [lo, hi), a column tile at a time through
// the table's fp32 row kernel: gate, up and out tiles (12 KiB) stay in L1.
// Widening a thread's whole share at once took ~100 MB of fresh scratch per
// thread at a 2048-token prefill of the 1B shape (73 ms a call, 2.3 s of a
// 9 s prefill). The tile is a multiple of every table's vector width, so each
// element takes the same vector or tail path as over the whole row.
constexpr int64_t kSiluTile = 1024;

static void silu_mul_rows_bf16(const c10::BFloat16* x, c10::BFloat16* out, int64_t d, int64_t lo, int64_t hi,
                               conveyor_cpu::SiluMulRowsFn fn) {
  alignas(64) float buf[3 * kSiluTile];
  for (int64_t r = lo; r < hi; ++r) {
    const c10::BFloat16* g = x + r * 2 * d;
    for (int64_t c = 0; c < d; c += kSiluTile) {
      const int64_t w = std::min(kSiluTile, d - c);
      widen_bf16(g + c, buf, w);
      widen_bf16(g + d + c, buf + w, w);
      fn(conveyor_cpu::SiluMulArgs{buf, buf + 2 * w, w}, 0, 1);
      round_bf16(buf + 2 * w, out + r * d + c, w);
    }
  }
}

// silu(gate) * up for the fused gate_up output: x fp32 or bf16 [T, 2d]
// contiguous -> a new contiguous [T, d] of x's dtype (the down projection reads
// it without a copy). bf16 is computed in fp32 and rounded once.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0 &&
              (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "x fp32 or bf16 [T, 2d] contiguous");
  const int64_t t = x.size(0), d = x.size(1) / 2;
  torch::Tensor out = torch::empty({t, d}, x.options());
  const conveyor_cpu::SiluMulRowsFn fn = active().silu_mul;
  if (x.scalar_type() == torch::kFloat32) {
    const conveyor_cpu::SiluMulArgs a{x.data_ptr<float>(), out.data_ptr<float>(), d};
    at::parallel_for(0, t, 8, [&](int64_t lo, int64_t hi) { fn(a, lo, hi); });
    return out;
  }
  const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, t, 8, [&](int64_t lo, int64_t hi) { silu_mul_rows_bf16(xb, ob, d, lo, hi, fn); });
  return out;
}

// The kernel tables: which one runs, which this CPU supports, and choosing one.
std::string isa() { return active().name; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const KernelTable* t : supported_tables()) out.emplace_back(t->name);
  return out;
}

void set_isa(const std::string& name) {
  std::vector<const KernelTable*> tables = supported_tables();
  const std::string best = tables.front()->name;
  if (name == "auto") {
    g_active.store(tables.front(), std::memory_order_release);
    return;
  }
  for (const KernelTable* t : tables)
    if (name == t->name) {
      g_active.store(t, std::memory_order_release);
      return;
    }
  TORCH_CHECK(false, "kernel ISA '", name, "' is not supported on this CPU (best: ", best, ")");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_short", &paged_attention_short, "paged attention for short queries (CPU)");
  m.def("paged_prefill", &paged_prefill, "paged attention for one long query chunk, fp32 or bf16 (CPU)");
  m.def("write_kv", &write_kv, "store K/V rows at their slots (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with the fused residual add (CPU)");
  m.def("rotary_neox", &rotary_neox, "neox rotary embedding in place, fp32 or bf16 (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate_up output, fp32 or bf16 (CPU)");
  m.def("decode_layers", &decode_layers, "decode rows through Llama-family layers on the plain linear kernel (CPU)");
  m.def("isa", &isa, "the kernel table in use: avx512, avx2 or portable");
  m.def("supported_isas", &supported_isas, "the kernel tables this CPU runs, best first");
  m.def("set_isa", &set_isa, "use this kernel table ('auto': the best supported)");
}
