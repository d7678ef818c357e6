// Paged attention for short queries (decode rows, speculative drafts) on CPU.
//
// Reads K/V in place from the paged cache [num_blocks, 2, block_size, Hkv, D]
// through the block table: no gathered copy, no padding, no mask tensor.
// One task per request (dynamic OpenMP schedule over torch's thread count). Math is fp32 whatever the storage dtype.
//
// Query token i of request b sits at position seq_len - q_len + i and sees keys
// 0..that position (causal within the drafts).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Shape {
  int64_t block_size, hkv, dim, group, max_blocks;
  int64_t q_tok_stride, q_head_stride;  // query / out strides, elements
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Sums kept in 16 explicit lanes so the compiler vectorizes without
// reassociating (d % 16 == 0 takes this path; other head sizes the scalar tail).
constexpr int64_t kLanes = 16;

template <typename T>
inline float dot(const float* __restrict__ q, const T* __restrict__ k, int64_t d) {
  float lane[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += q[i + l] * to_f(k[i + l]);
  float s = 0.f;
  for (; i < d; ++i) s += q[i] * to_f(k[i]);
  for (int64_t l = 0; l < kLanes; ++l) s += lane[l];
  return s;
}

template <typename T>
inline void axpy(float w, const T* __restrict__ v, float* __restrict__ acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += w * to_f(v[i]);
}

// One request: all its query heads times q_len tokens. Positions are walked
// in cache order, so each block's K (then V) rows are read as one sequential
// run of block_size * Hkv * D elements (random blocks, sequential inside).
template <typename T>
void attend_request(const T* query, const T* cache, const int32_t* blocks, int64_t start,
                    int64_t q_len, int64_t seq_len, float scale, const Shape& s, T* out) {
  const int64_t hq = s.hkv * s.group, rows = q_len * hq, d = s.dim;
  const int64_t off_stride = s.hkv * d;                 // one position, all kv heads
  const int64_t kv_stride = s.block_size * off_stride;  // K rows, then V rows, of a block
  std::vector<float> q(rows * d), acc(rows * d, 0.f), score(rows * seq_len), denom(rows);
  std::vector<int64_t> last(rows), head_off(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / hq, qh = r % hq;
    const T* src = query + (start + i) * s.q_tok_stride + qh * s.q_head_stride;
    for (int64_t x = 0; x < d; ++x) q[r * d + x] = to_f(src[x]) * scale;
    last[r] = seq_len - q_len + i;
    head_off[r] = (qh / s.group) * d;
  }
  for (int64_t p = 0; p < seq_len; ++p) {
    const T* blk = cache + int64_t(blocks[p / s.block_size]) * 2 * kv_stride;
    const T* k = blk + (p % s.block_size) * off_stride;
    if (p % s.block_size == 0 && p + s.block_size < seq_len)
      __builtin_prefetch(cache + int64_t(blocks[p / s.block_size + 1]) * 2 * kv_stride);
    for (int64_t r = 0; r < rows; ++r)
      score[r * seq_len + p] = p <= last[r] ? dot(&q[r * d], k + head_off[r], d) : 0.f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = &score[r * seq_len];
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p <= last[r]; ++p) mx = sc[p] > mx ? sc[p] : mx;
    float sum = 0.f;
    for (int64_t p = 0; p <= last[r]; ++p) {
      sc[p] = std::exp(sc[p] - mx);
      sum += sc[p];
    }
    denom[r] = sum;
  }
  for (int64_t p = 0; p < seq_len; ++p) {
    const T* v = cache + int64_t(blocks[p / s.block_size]) * 2 * kv_stride + kv_stride +
                 (p % s.block_size) * off_stride;
    for (int64_t r = 0; r < rows; ++r)
      if (p <= last[r]) axpy(score[r * seq_len + p], v + head_off[r], &acc[r * d], d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / hq, qh = r % hq;
    T* dst = out + (start + i) * s.q_tok_stride + qh * s.q_head_stride;
    const float inv = 1.f / denom[r];
    for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(acc[r * d + x] * inv);
  }
}

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
         const int64_t* reqs, const int64_t* starts, const int64_t* q_lens, const int64_t* seq_lens,
         int64_t n, double scale, torch::Tensor& out) {
  Shape s{kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), query.size(1) / kv_cache.size(3),
          block_table.size(1), query.stride(0), query.stride(1)};
  const T* q = query.data_ptr<T>();
  const T* c = kv_cache.data_ptr<T>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  // Dynamic schedule: request lengths differ a lot, a static split would idle a core.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < n; ++b)
    attend_request<T>(q, c, bt + reqs[b] * s.max_blocks, starts[b], q_lens[b], seq_lens[b],
                      static_cast<float>(scale), s, o);
}

}  // namespace

// query/out [T, Hq, D] (head dim contiguous), kv_cache contiguous, block_table
// int32 [R, M]; reqs/starts/q_lens/seq_lens int64 [n] on CPU. Writes only the
// rows of the n requests.
void paged_attention_short(const torch::Tensor& query, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_table, const torch::Tensor& reqs,
                           const torch::Tensor& starts, const torch::Tensor& q_lens,
                           const torch::Tensor& seq_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, Hq, D], D contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.strides() == query.strides(), "out must match query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-d");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "kv_cache and query dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous(), "block_table int32");
  const int64_t n = reqs.numel();
  const int64_t* r = reqs.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, query.scalar_type(),
                                  "paged_attention_short", [&] {
    run<scalar_t>(query, kv_cache, block_table, r, st, ql, sl, n, scale, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_short", &paged_attention_short, "paged attention for short queries (CPU)");
}
