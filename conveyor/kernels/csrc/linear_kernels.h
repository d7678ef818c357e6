// Small-M linears (decode batches) on CPU over weights packed once.
//
// Packed layout (conveyor/kernels/cpu_linear.py packs it): output columns in blocks of
// kBlockN = 16, N zero-padded to a multiple of 16 (np).
//   fp32: block b is [k][16]: per k the block's 16 weights, 64 bytes.
//   bf16: block b is [k / 2][16][2] (k zero-padded to even): per pair of k the
//         16 columns' two weights side by side, 64 bytes (vdpbf16ps' operand).
//   int8: block b is [k][16] as fp32, 16 bytes per k (weight-only int8: the
//         sums times a per-column scale are the output).
// A thread's range of blocks is one contiguous stream, read once per m-block
// of rows (all decode rows are one m-block) in address order, and each 64-byte
// line feeds one vector FMA per row with that row's x broadcast. oneDNN's
// packed GEMM reached half the FMA peak at M = 16 where this reaches 1.3-1.4x
// its speed (BENCHMARKS.md, "Small-M linears"); on AVX2 it stays ahead to 64
// rows ("x in place").
//
// Built into the CPU attention extension under cpu_kernels.h's rules: each ISA
// file raises its own target and keeps its code in an anonymous namespace; no
// torch headers and no allocation here (the glue, linear_cpu.cpp, owns the
// scratch and the threads).
#pragma once

#include <cstdint>

namespace conveyor_linear {

constexpr int64_t kBlockN = 16;   // output columns per packed block
// k per pass of a row block (the chunk's weights stay in L1/L2 for the
// m-block's next rows); fp32 takes kChunkKF32 (64 KiB of weights): 1024 ran
// 2-3% faster than 512 there at 32 and 2048 rows. bf16 and int8 unmeasured.
constexpr int64_t kChunkK = 512;
constexpr int64_t kChunkKF32 = 1024;

// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for the blocks [lo, hi).
struct LinearArgs {
  const void* w;      // packed weights, fp32 or bf16 (above)
  const void* x;      // fp32 x; for bf16_dot, x's bf16 pairs as uint32 (k below counts pairs)
  const float* bias;  // [np] or nullptr
  float* y;           // [m][np], fp32: the sums (between k chunks: partial ones)
  uint16_t* yb;       // [m][np] bf16, or nullptr: the last chunk's sums go here, rounded once
  const float* scale;  // [np] per-column scales of int8 weights (the sums are multiplied
                       // before the bias), or nullptr
  int64_t m, k, np;   // k: even for bf16 (padded)
  int64_t xk, xm;     // x's value at row i, k: x[i * xm + k * xk] (x^T [k][m]: xk = m, xm = 1;
                      // x row-major: xk = 1, xm = its row stride)
  int64_t next_k = 0;  // fp32 kernels: > 0 on a chunk's row passes after the first, which find
                       // the chunk in cache: prefetch the next chunk (this many k on) instead,
  int64_t next_every = 1, next_phase = 0;  // shared over those passes: this one takes the
                                           // k steps k0 + next_phase + j * next_every
};

// fp32 -> bf16 bits, round to nearest even (NaN -> a quiet NaN), as torch's
// scalar conversion; the vector tables round the same way.
inline uint16_t round_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
using LinearFn = void (*)(const LinearArgs&, int64_t lo, int64_t hi);

// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) over weights as the checkpoint
// holds them, row-major [n][k]: the parameter itself, no packed copy
// (linear_plain.inc), for up to kPlainDotRows rows. fp32, or bf16 x and w
// (fp32 sums, the output rounded once).
constexpr int64_t kPlainDotRows = 4;
struct PlainArgs {
  const void* w;      // [n][ldw], fp32 or bf16
  const void* x;      // [m][ldx], w's dtype
  const float* bias;  // [n] or nullptr
  float* y;           // [m][ldy] fp32 output, or nullptr (bf16)
  uint16_t* yb;       // [m][ldy] bf16 output, or nullptr (fp32)
  int64_t m, k, ldw, ldx, ldy;
};
// Columns [lo, hi) of y.
using PlainFn = void (*)(const PlainArgs&, int64_t lo, int64_t hi);

// Prefill-sized int8 GEMM (linear_cpu.cpp's linear_i8_tiled, where the table
// has one): y[m, n] = sum_k x[m, k] (float(q[n, k]) * scale[n]). The kernel
// widens kI8Group panels of 32 columns (two packed blocks) of one chunk of
// kI8ChunkK k into the thread's scratch, float(q) * scale as dequant_i8
// computes it, and runs every tile of kI8Rows rows of a pass of kI8PassTiles
// tiles against them, 14 rows x 32 columns of sums in registers. A pass's x
// rows and y stay in L2 across its k chunks; each converted panel is read from
// cache by every row tile, so the widening costs one pass over the int8 weight
// per pass of rows, where the tiled dequantize + GEMM wrote and re-read a
// 4 MiB fp32 tile (1B shapes at 512 rows, Xeon, 2 threads: 1.0-1.2x).
constexpr int64_t kI8Rows = 14;
constexpr int64_t kI8ChunkK = 384;
constexpr int64_t kI8Group = 16;
constexpr int64_t kI8PassTiles = 18;
struct I8GemmArgs {
  const float* x;       // [m][ldx]
  const int8_t* q;      // the int8 weight as packed ([nb][k][16])
  const float* scale;   // [nb * 16], zero past n
  float* y;             // [m][ldy]: columns [32 lo, 32 hi) are written (the last panel may be one block)
  float* scratch;       // this thread's kI8Group * kI8ChunkK * 32 floats, 64-byte aligned
  int64_t m, k, nb, ldx, ldy;
};
// Panels [lo, hi) of 32 columns (the last one 16 where nb is odd).
using I8GemmFn = void (*)(const I8GemmArgs&, int64_t lo, int64_t hi);

struct LinearTable {
  const char* name;
  LinearFn f32;        // fp32 weights, fp32 x^T
  LinearFn bf16_wide;  // bf16 weights widened to fp32 in registers (exact), fp32 x^T: fp32 math
  LinearFn bf16_dot;   // bf16 weights and x pairs, vdpbf16ps (exact products, fp32 sums); nullptr: none
  LinearFn i8;         // int8 weights ([k][16] bytes per block) widened in registers, fp32 x^T, scale
  PlainFn f32_plain;   // fp32 weights as they are ([n][k]), fp32 x row-major
  PlainFn bf16_plain;  // bf16 weights as they are and bf16 x, vdpbf16ps; nullptr: none
  I8GemmFn i8_gemm = nullptr;  // prefill-sized int8 (above); nullptr: dequantized tiles and torch's GEMM
};

const LinearTable* linear_portable();
const LinearTable* linear_avx2();        // nullptr off x86
const LinearTable* linear_avx512();      // nullptr off x86
const LinearTable* linear_avx512bf16();  // nullptr off x86 or without compiler support

}  // namespace conveyor_linear
