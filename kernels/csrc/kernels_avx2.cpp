// AVX2 + FMA kernels (raised target for this file's own code only, see
// cpu_kernels.h): the AVX-512 path's fp32 decode attention 8 floats wide, with
// the same exp polynomial, fp32 accumulation and masked tails, the neox
// rotary 8 floats at a time, and the generic loops compiled for AVX2.
#include "cpu_kernels.h"

#include <cmath>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {
#include "generic_kernels.inc"

// exp(x) for x <= 0, as exp512: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, p the
// degree-7 Taylor polynomial; below -87.3 the result is 0. n >= -126, so 2^n
// is built from its exponent bits (a normal float).
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Lanes [0, left) set (all of them from 8 on).
inline __m256i tail_mask(int64_t left) {
  const int32_t k = left >= 8 ? 8 : static_cast<int32_t>(left);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Row r's scores 0..last become exp(s - max), the rest 0; returns their sum
// and stores the max in *max_out.
inline float softmax_row(float* sc, int64_t last, int64_t seq_len, float* max_out) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mv = ninf;
  for (int64_t p = 0; p <= last; p += 8) {
    const __m256i m = tail_mask(last + 1 - p);  // masked lanes are not read
    mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(sc + p, m), _mm256_castsi256_ps(m)));
  }
  *max_out = hmax(mv);
  const __m256 mx = _mm256_set1_ps(*max_out);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t p = 0; p <= last; p += 8) {
    const __m256i m = tail_mask(last + 1 - p);
    const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(m),
                                   exp256(_mm256_sub_ps(_mm256_maskload_ps(sc + p, m), mx)));
    sum = _mm256_add_ps(sum, e);
    _mm256_maskstore_ps(sc + p, m, e);
  }
  for (int64_t p = last + 1; p < seq_len; ++p) sc[p] = 0.f;
  return hsum(sum);
}

// Software prefetch of the row kAhead positions on, into L2 (see kernels_avx512.cpp).
constexpr int64_t kAhead = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {  // n elements, one request per 64-byte line
  const char* b = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) _mm_prefetch(b + i, _MM_HINT_T1);
}

// 8 values of a K/V/query row as fp32 (bf16 by a shift, fp16 by vcvtph2ps:
// both exact), and the output row rounded as static_cast does.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
template <typename T>
inline void store8(T* dst, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int l = 0; l < 8; ++l) dst[l] = static_cast<T>(tmp[l]);
}

// A head's row as fp32: a float cache is read in place; bf16/fp16 rows are
// widened once into buf (L1) and then used by every query row of the group.
template <int NV>
inline const float* widen_row(const float* src, float*) { return src; }
template <int NV, typename T>
inline const float* widen_row(const T* src, float* buf) {
  for (int j = 0; j < NV; ++j) _mm256_store_ps(buf + 8 * j, load8(src + 8 * j));
  return buf;
}

template <typename T, int NV>
void attend_avx2(const AttnBatch<T>& a, const Req& rq, float* scratch) {
  constexpr int64_t D = NV * 8;
  const Shape& s = a.s;
  const int64_t hkv = s.hkv, g = s.group, hq = hkv * g, rows = rq.q_len * hq, n = rq.seq_len;
  const int64_t off_stride = hkv * D, vs = kv_stride(s);
  float* q = scratch;
  float* acc = q + rows * D;
  float* score = acc + rows * D;
  float* denom = score + rows * n;
  float* rmax = denom + rows;
  const __m256 sv = _mm256_set1_ps(a.scale);
  alignas(32) float row_buf[NV * 8];
  for (int64_t r = 0; r < rows; ++r) {  // row r = query token r / hq, head r % hq
    const T* src = a.query + (rq.start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      _mm256_storeu_ps(q + r * D + 8 * j, _mm256_mul_ps(load8(src + 8 * j), sv));
      _mm256_storeu_ps(acc + r * D + 8 * j, _mm256_setzero_ps());
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    const T* kp = k_row(a.cache, rq.blocks, p, s);
    if (p + kAhead < n) prefetch_row(k_row(a.cache, rq.blocks, p + kAhead, s), off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      const float* kh = widen_row<NV>(kp + h * D, row_buf);  // L1-resident after the group's first row
      for (int64_t i = 0; i < rq.q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const float* qr = q + r * D;
          __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kh));
          __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(qr + 8), _mm256_loadu_ps(kh + 8));
          for (int j = 2; j < NV; j += 2) {  // two chains: FMA latency
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), _mm256_loadu_ps(kh + 8 * j), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j + 8), _mm256_loadu_ps(kh + 8 * j + 8), s1);
          }
          score[r * n + p] = hsum(_mm256_add_ps(s0, s1));
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r) denom[r] = softmax_row(score + r * n, n - rq.q_len + r / hq, n, rmax + r);
  for (int64_t p = 0; p < n; ++p) {  // weights past a row's last position are 0
    const T* vp = k_row(a.cache, rq.blocks, p, s) + vs;
    if (p + kAhead < n) prefetch_row(k_row(a.cache, rq.blocks, p + kAhead, s) + vs, off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      const float* vh = widen_row<NV>(vp + h * D, row_buf);
      for (int64_t i = 0; i < rq.q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const __m256 w = _mm256_set1_ps(score[r * n + p]);
          float* ar = acc + r * D;
          for (int j = 0; j < NV; ++j)
            _mm256_storeu_ps(ar + 8 * j, _mm256_fmadd_ps(w, _mm256_loadu_ps(vh + 8 * j), _mm256_loadu_ps(ar + 8 * j)));
        }
    }
  }
  if (rq.part != nullptr) {
    store_part(rq, rows, D, acc, denom, rmax);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = a.out + (rq.start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    const __m256 inv = _mm256_set1_ps(1.f / denom[r]);
    for (int j = 0; j < NV; ++j) store8(dst + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + 8 * j), inv));
  }
}

conveyor_cpu::AttendFn<float> attend_f32(int64_t dim) {
  if (dim == 64) return &attend_avx2<float, 8>;
  if (dim == 128) return &attend_avx2<float, 16>;
  if (dim == 32) return &attend_avx2<float, 4>;
  return &attend_generic<float>;
}

// bf16 / fp16 caches: the same kernel over rows widened to fp32 (widen_row).
template <typename T>
void attend_half(const AttnBatch<T>& a, const Req& rq, float* scratch) {
  switch (a.s.dim) {
    case 64: attend_avx2<T, 8>(a, rq, scratch); return;
    case 128: attend_avx2<T, 16>(a, rq, scratch); return;
    case 32: attend_avx2<T, 4>(a, rq, scratch); return;
    default: attend_generic<T>(a, rq, scratch);
  }
}

// 8 dims at a time; mul, mul, sub (add) each rounded, as the scalar form.
void rotary_rows(const RotaryArgs& args, int64_t lo, int64_t hi) {
  rotary_rows_with(args, lo, hi, [](float* x, const float* c, const float* sn, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
      const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(sn + i);
      _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)));
      _mm256_storeu_ps(x + i + half, _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)));
    }
    rotate_tail(x, c, sn, i, half);
  });
}

// silu(g) * u, 8 at a time, as the AVX-512 one (exp of -|g| only).
void silu_mul_rows(const conveyor_cpu::SiluMulArgs& a, int64_t lo, int64_t hi) {
  silu_mul_rows_with(a, lo, hi, [](const float* g, const float* u, float* o, int64_t d) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = exp256(_mm256_or_ps(x, sign));  // -|x|
      const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
      const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
    silu_mul_tail(g, u, o, i, d);
  });
}

// Weight-only int8 linear, AVX2: 16 weights of a row per step (two
// chains), converted to fp32 in registers and used by up to 4 input rows.
template <int MB>
void int8_block_avx2(const conveyor_cpu::Int8LinearArgs& a, const int8_t* wr, int64_t m0, int64_t n) {
  const int64_t K = a.k, kv = K & ~int64_t(15);
  __m256 acc[MB][2];
  for (int j = 0; j < MB; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kv; k += 16) {
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k))));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k + 8))));
    for (int j = 0; j < MB; ++j) {
      const float* xr = a.x + (m0 + j) * K + k;
      acc[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[j][1]);
    }
  }
  for (int j = 0; j < MB; ++j) {
    const float* xr = a.x + (m0 + j) * K;
    float s = hsum(_mm256_add_ps(acc[j][0], acc[j][1]));
    for (int64_t k = kv; k < K; ++k) s += xr[k] * static_cast<float>(wr[k]);
    a.y[(m0 + j) * a.n + n] = s * a.scale[n] + (a.bias ? a.bias[n] : 0.f);
  }
}

void int8_linear(const conveyor_cpu::Int8LinearArgs& a, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) {
    const int8_t* wr = a.w + n * a.k;
    if (n + 1 < hi)
      for (int64_t k = 0; k < a.k; k += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + a.k + k), _MM_HINT_T0);
    int64_t m0 = 0;
    for (; m0 + 4 <= a.m; m0 += 4) int8_block_avx2<4>(a, wr, m0, n);
    switch (a.m - m0) {
      case 3: int8_block_avx2<3>(a, wr, m0, n); break;
      case 2: int8_block_avx2<2>(a, wr, m0, n); break;
      case 1: int8_block_avx2<1>(a, wr, m0, n); break;
      default: break;
    }
  }
}
}  // namespace

#pragma GCC pop_options

namespace conveyor_cpu {

const KernelTable* table_avx2() {
  static const KernelTable t{"avx2", &attend_f32, &attend_half<c10::Half>,
                             &attend_half<c10::BFloat16>, &rotary_rows, &rms_rows<float>,
                             &rms_rows<c10::Half>, &rms_rows<c10::BFloat16>, &int8_linear,
                             &silu_mul_rows};
  return &t;
}

}  // namespace conveyor_cpu

#else
namespace conveyor_cpu {
const KernelTable* table_avx2() { return nullptr; }
}  // namespace conveyor_cpu
#endif
