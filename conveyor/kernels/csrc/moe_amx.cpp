// bf16 small-M linears on AMX tiles, a LinearFn (linear_kernels.h) for the
// grouped experts op (moe_cpu.cpp) on CPUs with AMX-BF16.
//
// Operands as the avx512bf16 table reads them: w = cpu_linear.pack'ed bf16
// blocks [kp / 2][16][2], which is exactly an AMX B tile per 32 k (16 rows of
// k pairs, 64 bytes each); x = bf16 rows in place (xk = 1, xm = a row in
// uint32 pairs), an A tile per 16 rows and 32 k. A tiles always load 16 rows:
// the caller's x has 15 readable rows past its last (their sums are never
// stored). Four column blocks share each A load (C tiles 1-4, B tiles 5 and 6
// alternate). Sums are fp32 over all of k in the tiles, the output is
// rounded to bf16 once, as the other tables do. Requires kp % 32 == 0 (the glue
// checks) and the process's AMX permission (amx_request_permission).
//
// Compiled under its own raised target in an anonymous namespace, like the
// other ISA files (cpu_kernels.h): nothing here is inline code with external
// linkage.
#include "linear_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")

namespace {
using conveyor_linear::kBlockN;
using conveyor_linear::LinearArgs;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile 0: A (16 rows x 32 bf16); 1-4: C (16 rows x 16 fp32); 5, 6: B (16 pairs
// x 16 columns): every tile 16 rows of 64 bytes.
void configure() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t <= 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

#include "bf16_avx512.inc"

// A C tile's first `rows` rows, rounded to bf16, into yb (row stride ld).
inline void store_rows(const float* c, int rows, uint16_t* yb, int64_t ld) {
  for (int i = 0; i < rows; ++i) store_bf16x16(yb + i * ld, _mm512_loadu_ps(c + i * kBlockN));
}

// Four column blocks nb..nb+3 of one 16-row slice over all of k.
void four_blocks(const LinearArgs& a, const char* xa, int64_t xstride, int64_t nb, int rows, uint16_t* yb) {
  const int64_t block = a.k / 2 * 64;  // bytes of one packed block
  const char* w = static_cast<const char*>(a.w) + nb * block;
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  for (int64_t k0 = 0; k0 < a.k; k0 += 32) {
    const char* wk = w + k0 / 2 * 64;
    _tile_loadd(0, xa + k0 * 2, xstride);
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(1, 0, 5);
    _tile_loadd(6, wk + block, 64);
    _tile_dpbf16ps(2, 0, 6);
    _tile_loadd(5, wk + 2 * block, 64);
    _tile_dpbf16ps(3, 0, 5);
    _tile_loadd(6, wk + 3 * block, 64);
    _tile_dpbf16ps(4, 0, 6);
  }
  alignas(64) float c[4][16 * kBlockN];
  _tile_stored(1, c[0], 64);
  _tile_stored(2, c[1], 64);
  _tile_stored(3, c[2], 64);
  _tile_stored(4, c[3], 64);
  for (int j = 0; j < 4; ++j) store_rows(c[j], rows, yb + (nb + j) * kBlockN, a.np);
}

void one_block(const LinearArgs& a, const char* xa, int64_t xstride, int64_t nb, int rows, uint16_t* yb) {
  const int64_t block = a.k / 2 * 64;
  const char* w = static_cast<const char*>(a.w) + nb * block;
  _tile_zero(1);
  for (int64_t k0 = 0; k0 < a.k; k0 += 32) {
    _tile_loadd(0, xa + k0 * 2, xstride);
    _tile_loadd(5, w + k0 / 2 * 64, 64);
    _tile_dpbf16ps(1, 0, 5);
  }
  alignas(64) float c[16 * kBlockN];
  _tile_stored(1, c, 64);
  store_rows(c, rows, yb + nb * kBlockN, a.np);
}

// Blocks [lo, hi) for every row: bf16 x pairs in place, bf16 output in a.yb.
// Four blocks at a time, under them every 16-row slice (the blocks' weights,
// 4 x kp x 32 bytes, stay in L2 across the slices).
void amx_bf16(const LinearArgs& a, int64_t lo, int64_t hi) {
  const int64_t xstride = a.xm * 4;  // bytes between rows (xm counts uint32 pairs)
  configure();
  for (int64_t nb = lo; nb < hi;) {
    const bool four = nb + 4 <= hi;
    for (int64_t m0 = 0; m0 < a.m; m0 += 16) {
      const int rows = static_cast<int>(a.m - m0 < 16 ? a.m - m0 : 16);
      const char* xa = static_cast<const char*>(a.x) + m0 * xstride;
      uint16_t* yb = a.yb + m0 * a.np;
      if (four) four_blocks(a, xa, xstride, nb, rows, yb);
      else one_block(a, xa, xstride, nb, rows, yb);
    }
    nb += four ? 4 : 1;
  }
  _tile_release();
}
}  // namespace

#pragma GCC pop_options

namespace conveyor_linear {
bool amx_request_permission() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
  if (!tile || !bf16) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
LinearFn linear_amx_bf16() { return &amx_bf16; }
}  // namespace conveyor_linear

#else
namespace conveyor_linear {
bool amx_request_permission() { return false; }
LinearFn linear_amx_bf16() { return nullptr; }
}  // namespace conveyor_linear
#endif
