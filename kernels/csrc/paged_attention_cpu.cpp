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
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Shape {
  int64_t block_size, hkv, dim, group, max_blocks;
  int64_t q_tok_stride, q_head_stride;  // query / out strides, elements
};

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Position p's K row (every kv head's D values) through the block table; its
// V row is kv_stride(s) further on (a block holds its K rows, then its V rows).
inline int64_t kv_stride(const Shape& s) { return s.block_size * s.hkv * s.dim; }

template <typename T>
inline const T* k_row(const T* cache, const int32_t* blocks, int64_t p, const Shape& s) {
  return cache + int64_t(blocks[p / s.block_size]) * 2 * kv_stride(s) + (p % s.block_size) * s.hkv * s.dim;
}

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
  const int64_t vs = kv_stride(s);
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
    const T* k = k_row(cache, blocks, p, s);
    if (p % s.block_size == 0 && p + s.block_size < seq_len)
      __builtin_prefetch(k_row(cache, blocks, p + s.block_size, s));
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
    const T* v = k_row(cache, blocks, p, s) + vs;
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


#if defined(__AVX512F__)
// fp32 with head size 16 * NV, AVX-512 (the reference dtype on x86 servers).
// Same three passes as attend_request, with the K/V rows of a position held
// in NV registers and shared by the GQA group, one exp per 16 scores, and
// per-thread scratch (no allocation per request).

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), x = n ln2 + r,
// |r| <= ln2/2, p the degree-7 Taylor polynomial (relative error < 1e-8,
// under fp32's rounding); below -87.3 the result is 0, as expf's.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// Row r's scores 0..last become exp(s - max), the rest 0; returns their sum.
inline float softmax_row(float* sc, int64_t last, int64_t seq_len) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p <= last; p += 16) {
    const __mmask16 m = tail_mask(last + 1 - p);  // masked lanes are not read
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, sc + p));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t p = 0; p <= last; p += 16) {
    const __mmask16 m = tail_mask(last + 1 - p);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p), mx)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(sc + p, m, e);
  }
  for (int64_t p = last + 1; p < seq_len; ++p) sc[p] = 0.f;
  return _mm512_reduce_add_ps(sum);
}

// Blocks sit anywhere in the cache (and pages end every 4 KB), so the
// hardware prefetcher loses the stream at every edge: each position asks for
// the row kAhead positions on (one position's K or V row, all kv heads,
// 64-byte lines), into L2: with 8 layers' caches far past L3 this doubled
// the bytes per second read (8 -> 15 GB/s on one Zen 4 core; into L1 the
// requests queue behind its few miss buffers and gained nothing).
constexpr int64_t kAhead = 8;

inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T1);
}

template <int NV>
void attend_request_avx512(const float* query, const float* cache, const int32_t* blocks,
                           int64_t start, int64_t q_len, int64_t seq_len, float scale,
                           const Shape& s, float* out) {
  constexpr int64_t D = NV * 16;
  const int64_t hkv = s.hkv, g = s.group, hq = hkv * g, rows = q_len * hq;
  const int64_t off_stride = hkv * D, vs = kv_stride(s);
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows * (2 * D + seq_len + 1)));
  float* q = scratch.data();
  float* acc = q + rows * D;
  float* score = acc + rows * D;
  float* denom = score + rows * seq_len;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {  // row r = query token r / hq, head r % hq
    const float* src = query + (start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      _mm512_storeu_ps(q + r * D + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(src + 16 * j), sv));
      _mm512_storeu_ps(acc + r * D + 16 * j, _mm512_setzero_ps());
    }
  }
  for (int64_t p = 0; p < seq_len; ++p) {
    const float* kp = k_row(cache, blocks, p, s);
    if (p + kAhead < seq_len) prefetch_row(k_row(cache, blocks, p + kAhead, s), off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      __m512 k[NV];
      for (int j = 0; j < NV; ++j) k[j] = _mm512_loadu_ps(kp + h * D + 16 * j);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const float* qr = q + r * D;
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qr), k[0]);
          for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * j), k[j], a);
          score[r * seq_len + p] = _mm512_reduce_add_ps(a);
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    denom[r] = softmax_row(score + r * seq_len, seq_len - q_len + r / hq, seq_len);
  for (int64_t p = 0; p < seq_len; ++p) {  // weights past a row's last position are 0
    const float* vp = k_row(cache, blocks, p, s) + vs;
    if (p + kAhead < seq_len) prefetch_row(k_row(cache, blocks, p + kAhead, s) + vs, off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      __m512 v[NV];
      for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vp + h * D + 16 * j);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const __m512 w = _mm512_set1_ps(score[r * seq_len + p]);
          float* ar = acc + r * D;
          for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(ar + 16 * j, _mm512_fmadd_ps(w, v[j], _mm512_loadu_ps(ar + 16 * j)));
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + (start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(dst + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * j), inv));
  }
}
#endif

// The fp32 AVX-512 path for its head sizes, else nullptr (the portable loop).
template <typename T>
using RequestFn = void (*)(const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, float,
                           const Shape&, T*);

template <typename T>
RequestFn<T> fast_path(int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (dim == 64) return &attend_request_avx512<4>;
    if (dim == 128) return &attend_request_avx512<8>;
    if (dim == 32) return &attend_request_avx512<2>;
  }
#endif
  (void)dim;
  return nullptr;
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
  const RequestFn<T> request = fast_path<T>(s.dim);
  // Dynamic schedule: request lengths differ a lot, a static split would idle a core.
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < n; ++b)
    (request ? request : &attend_request<T>)(q, c, bt + reqs[b] * s.max_blocks, starts[b], q_lens[b],
                                              seq_lens[b], static_cast<float>(scale), s, o);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, x.scalar_type(),
                                  "rms_norm", [&] {
    const scalar_t* in = sum.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const scalar_t* xr = in + r * h;
        float lane[kLanes] = {0.f};
        int64_t i = 0;
        for (; i + kLanes <= h; i += kLanes)
          for (int64_t l = 0; l < kLanes; ++l) lane[l] += to_f(xr[i + l]) * to_f(xr[i + l]);
        float ss = 0.f;
        for (; i < h; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
        for (int64_t l = 0; l < kLanes; ++l) ss += lane[l];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
        scalar_t* orow = o + r * h;
        for (int64_t j = 0; j < h; ++j)
          orow[j] = static_cast<scalar_t>(to_f(w[j]) * to_f(static_cast<scalar_t>(to_f(xr[j]) * inv)));
      }
    });
  });
  return {out, sum};
}


// Neox rotary embedding in place on fp32 query [T, Hq*D] and key [T, Hkv*D]
// (each row's heads contiguous; rows may be strided views of the qkv output):
// the first rd = cos_sin.size(1) dims of each head, (x1, x2) ->
// (x1 c - x2 s, x2 c + x1 s), c|s = cos_sin[position]. Built with
// -ffp-contract=off, so each product is rounded as the torch form rounds it.
void rotary_neox(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                 const torch::Tensor& cos_sin, int64_t head_size) {
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.dim() == 1,
              "positions int64 [T]");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.dim() == 2,
              "cos_sin fp32 [P, rd]");
  const int64_t t = positions.numel(), rd = cos_sin.size(1), half = rd / 2, max_pos = cos_sin.size(0);
  TORCH_CHECK(rd % 2 == 0 && rd <= head_size, "rotary dim must be even and at most the head size");
  for (const torch::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->scalar_type() == torch::kFloat32 && x->dim() == 2 && x->size(0) == t && x->stride(1) == 1 &&
                x->size(1) % head_size == 0, "query/key fp32 [T, H*D], D contiguous");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position out of range");
  const float* table = cos_sin.data_ptr<float>();
  float* xs[2] = {query.data_ptr<float>(), key.data_ptr<float>()};
  const int64_t strides[2] = {query.stride(0), key.stride(0)};
  const int64_t heads[2] = {query.size(1) / head_size, key.size(1) / head_size};
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* c = table + pos[r] * rd;
      const float* sn = c + half;
      for (int w = 0; w < 2; ++w)
        for (int64_t h = 0; h < heads[w]; ++h) {
          float* x = xs[w] + r * strides[w] + h * head_size;
          for (int64_t i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] - b * sn[i];
            x[i + half] = b * c[i] + a * sn[i];
          }
        }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_short", &paged_attention_short, "paged attention for short queries (CPU)");
  m.def("write_kv", &write_kv, "store K/V rows at their slots (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with the fused residual add (CPU)");
  m.def("rotary_neox", &rotary_neox, "neox rotary embedding in place, fp32 (CPU)");
}
