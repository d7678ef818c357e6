// AVX-512 kernels (raised target for this file's own code only, see cpu_kernels.h):
// fp32 decode attention at head size 16 * NV in intrinsics, the neox rotary
// 16 floats at a time, and the generic loops compiled for AVX-512.
#include "cpu_kernels.h"

#include <cmath>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace {
#include "generic_kernels.inc"

// Same three passes as attend_generic, with the K/V rows of a position held
// in NV registers and shared by the GQA group, one exp per 16 scores.

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

// Row r's scores 0..last become exp(s - max), the rest 0; returns their sum
// and stores the max in *max_out.
inline float softmax_row(float* sc, int64_t last, int64_t seq_len, float* max_out) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p <= last; p += 16) {
    const __mmask16 m = tail_mask(last + 1 - p);  // masked lanes are not read
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, sc + p));
  }
  *max_out = _mm512_reduce_max_ps(mv);
  const __m512 mx = _mm512_set1_ps(*max_out);
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

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {  // n elements, one request per 64-byte line
  const char* b = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) _mm_prefetch(b + i, _MM_HINT_T1);
}

// 16 values of a K/V/query row as fp32: bf16 widens by a shift (exact), fp16
// by vcvtph2ps (exact), so every storage dtype runs the same fp32 math.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The output row: fp32 stored as is; bf16/fp16 rounded as static_cast does
// (the generic kernel's rounding, so the paths agree bit for bit).
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
template <typename T>
inline void store16(T* dst, __m512 v) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int l = 0; l < 16; ++l) dst[l] = static_cast<T>(tmp[l]);
}

template <typename T, int NV>
void attend_avx512(const AttnBatch<T>& a, const Req& rq, float* scratch) {
  constexpr int64_t D = NV * 16;
  const Shape& s = a.s;
  const int64_t hkv = s.hkv, g = s.group, hq = hkv * g, rows = rq.q_len * hq, n = rq.seq_len;
  const int64_t off_stride = hkv * D, vs = kv_stride(s);
  float* q = scratch;
  float* acc = q + rows * D;
  float* score = acc + rows * D;
  float* denom = score + rows * n;
  float* rmax = denom + rows;
  const __m512 sv = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {  // row r = query token r / hq, head r % hq
    const T* src = a.query + (rq.start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    for (int j = 0; j < NV; ++j) {
      _mm512_storeu_ps(q + r * D + 16 * j, _mm512_mul_ps(load16(src + 16 * j), sv));
      _mm512_storeu_ps(acc + r * D + 16 * j, _mm512_setzero_ps());
    }
  }
  for (int64_t p = 0; p < n; ++p) {
    const T* kp = k_row(a.cache, rq.blocks, p, s);
    if (p + kAhead < n) prefetch_row(k_row(a.cache, rq.blocks, p + kAhead, s), off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      __m512 k[NV];
      for (int j = 0; j < NV; ++j) k[j] = load16(kp + h * D + 16 * j);
      for (int64_t i = 0; i < rq.q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const float* qr = q + r * D;
          __m512 acc_v = _mm512_mul_ps(_mm512_loadu_ps(qr), k[0]);
          for (int j = 1; j < NV; ++j) acc_v = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * j), k[j], acc_v);
          score[r * n + p] = _mm512_reduce_add_ps(acc_v);
        }
    }
  }
  for (int64_t r = 0; r < rows; ++r) denom[r] = softmax_row(score + r * n, n - rq.q_len + r / hq, n, rmax + r);
  for (int64_t p = 0; p < n; ++p) {  // weights past a row's last position are 0
    const T* vp = k_row(a.cache, rq.blocks, p, s) + vs;
    if (p + kAhead < n) prefetch_row(k_row(a.cache, rq.blocks, p + kAhead, s) + vs, off_stride);
    for (int64_t h = 0; h < hkv; ++h) {
      __m512 v[NV];
      for (int j = 0; j < NV; ++j) v[j] = load16(vp + h * D + 16 * j);
      for (int64_t i = 0; i < rq.q_len; ++i)
        for (int64_t x = 0; x < g; ++x) {
          const int64_t r = i * hq + h * g + x;
          const __m512 w = _mm512_set1_ps(score[r * n + p]);
          float* ar = acc + r * D;
          for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(ar + 16 * j, _mm512_fmadd_ps(w, v[j], _mm512_loadu_ps(ar + 16 * j)));
        }
    }
  }
  if (rq.part != nullptr) {
    store_part(rq, rows, D, acc, denom, rmax);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = a.out + (rq.start + r / hq) * s.q_tok_stride + (r % hq) * s.q_head_stride;
    const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
    for (int j = 0; j < NV; ++j) store16(dst + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * j), inv));
  }
}

conveyor_cpu::AttendFn<float> attend_f32(int64_t dim) {
  if (dim == 64) return &attend_avx512<float, 4>;
  if (dim == 128) return &attend_avx512<float, 8>;
  if (dim == 32) return &attend_avx512<float, 2>;
  return &attend_generic<float>;
}

// bf16 / fp16 caches (dtype: bfloat16 / float16): the same kernel, rows
// widened to fp32 in registers; other head sizes take the generic loop.
template <typename T>
void attend_half(const AttnBatch<T>& a, const Req& rq, float* scratch) {
  switch (a.s.dim) {
    case 64: attend_avx512<T, 4>(a, rq, scratch); return;
    case 128: attend_avx512<T, 8>(a, rq, scratch); return;
    case 32: attend_avx512<T, 2>(a, rq, scratch); return;
    default: attend_generic<T>(a, rq, scratch);
  }
}

// 16 dims at a time; mul, mul, sub (add) each rounded, as the scalar form.
void rotary_rows(const RotaryArgs& args, int64_t lo, int64_t hi) {
  rotary_rows_with(args, lo, hi, [](float* x, const float* c, const float* sn, int64_t half) {
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + half);
      const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(sn + i);
      _mm512_storeu_ps(x + i, _mm512_sub_ps(_mm512_mul_ps(a, cv), _mm512_mul_ps(b, sv)));
      _mm512_storeu_ps(x + i + half, _mm512_add_ps(_mm512_mul_ps(b, cv), _mm512_mul_ps(a, sv)));
    }
    rotate_tail(x, c, sn, i, half);
  });
}

// silu(g) * u, 16 at a time: exp only ever sees -|g| <= 0 (exp512's
// range); sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|).
void silu_mul_rows(const conveyor_cpu::SiluMulArgs& a, int64_t lo, int64_t hi) {
  silu_mul_rows_with(a, lo, hi, [](const float* g, const float* u, float* o, int64_t d) {
    const __m512 one = _mm512_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sig = _mm512_mask_mul_ps(r, neg, e, r);
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
    }
    silu_mul_tail(g, u, o, i, d);
  });
}

// Weight-only int8 linear, AVX-512: 32 weights of a row per step (two
// chains), converted to fp32 in registers and used by up to 4 input rows.
template <int MB>
void int8_block_avx512(const conveyor_cpu::Int8LinearArgs& a, const int8_t* wr, int64_t m0, int64_t n) {
  const int64_t K = a.k, kv = K & ~int64_t(31);
  __m512 acc[MB][2];
  for (int j = 0; j < MB; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 32) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16))));
    for (int j = 0; j < MB; ++j) {
      const float* xr = a.x + (m0 + j) * K + k;
      acc[j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[j][1]);
    }
  }
  for (int j = 0; j < MB; ++j) {
    const float* xr = a.x + (m0 + j) * K;
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
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
    for (; m0 + 4 <= a.m; m0 += 4) int8_block_avx512<4>(a, wr, m0, n);
    switch (a.m - m0) {
      case 3: int8_block_avx512<3>(a, wr, m0, n); break;
      case 2: int8_block_avx512<2>(a, wr, m0, n); break;
      case 1: int8_block_avx512<1>(a, wr, m0, n); break;
      default: break;
    }
  }
}
}  // namespace

#pragma GCC pop_options

namespace conveyor_cpu {

const KernelTable* table_avx512() {
  static const KernelTable t{"avx512", &attend_f32, &attend_half<c10::Half>,
                             &attend_half<c10::BFloat16>, &rotary_rows, &rms_rows<float>,
                             &rms_rows<c10::Half>, &rms_rows<c10::BFloat16>, &int8_linear,
                             &silu_mul_rows};
  return &t;
}

}  // namespace conveyor_cpu

#else
namespace conveyor_cpu {
const KernelTable* table_avx512() { return nullptr; }
}  // namespace conveyor_cpu
#endif
