// A mixture-of-experts layer's experts on CPU in one op (conveyor/kernels/cpu_moe.py):
//
//   torch.ops.conveyor_moe.experts(x [T, H], w13, w2, I, topk_ids [T, k] int64,
//       topk_weights [T, k] fp32, first_expert, isa) -> [T, H] of x's dtype
//   torch.ops.conveyor_moe.amx_ready() -> bool: isa "amx" may be asked for
//
// isa: a linear table's name, or "amx": bf16 GEMMs on AMX tiles (moe_amx.cpp)
// where the sizes are multiples of 32.
//
// w13 = the local experts' gate/up matrices [E, 2I, H] and w2 = their down
// matrices [E, H, I], each expert packed by cpu_linear.pack and stacked:
// [E, nb, K, 16] fp32, [E, nb, K / 2, 16, 2] bf16. The output is this rank's
// partial sum: pairs routed to experts outside [first_expert, first_expert + E)
// are another rank's.
//
// Steps, each one parallel region over torch's threads:
//   1. the (token, expert) pairs sorted by expert, stable (a counting sort);
//   2. x's rows gathered in that order (one contiguous run of rows per expert);
//   3. the gate/up GEMM of every expert: its rows against its packed blocks,
//      the (expert, column block) items split over the threads by cost, each
//      thread's share a run of whole blocks in address order (the small-M
//      kernels of linear_kernels.h; an expert's rows go through them in
//      m-blocks, so any row count works);
//   4. silu(gate) * up (paged_attention_cpu.cpp's silu_and_mul);
//   5. the down GEMM, as 3;
//   6. per token, its pairs' outputs times their router weights summed in
//      ascending expert order into fp32, as the per-expert loop's index_add_
//      did (conveyor/workers/layers/moe.py), then rounded once to x's dtype.
// Per expert this is exactly the per-expert linear's arithmetic (the same
// kernel, the same k order), so the grouped op and the loop agree bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "linear_tables.h"

at::Tensor silu_and_mul(const at::Tensor& x);  // paged_attention_cpu.cpp (torch::Tensor is at::Tensor)

namespace {
using conveyor_linear::kBlockN;
using conveyor_linear::LinearArgs;
using conveyor_linear::LinearFn;
using conveyor_linear::LinearTable;

// The local experts' pairs sorted by expert; within an expert, tokens ascend.
struct Pairs {
  std::vector<int64_t> offset;  // [E + 1]: local expert e's pairs are [offset[e], offset[e + 1])
  std::vector<int64_t> token;   // [P] the pair's token
  std::vector<int64_t> slot;    // [T * k] the pair's sorted position, -1: another rank's expert
};

Pairs sort_pairs(const at::Tensor& ids, int64_t first, int64_t e) {
  const int64_t n = ids.numel(), k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  Pairs p;
  p.offset.assign(e + 1, 0);
  p.slot.assign(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = id[i] - first;
    if (0 <= l && l < e) ++p.offset[l + 1];
  }
  for (int64_t l = 0; l < e; ++l) p.offset[l + 1] += p.offset[l];
  std::vector<int64_t> next(p.offset.begin(), p.offset.end() - 1);
  p.token.resize(p.offset[e]);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = id[i] - first;
    if (l < 0 || l >= e) continue;
    const int64_t s = next[l]++;
    p.token[s] = i / k;
    p.slot[i] = s;
  }
  return p;
}

// One grouped GEMM: every expert's rows of x (contiguous, from row
// offset[e]) against that expert's packed weights.
struct Grouped {
  LinearFn fn;
  const char* w;        // expert 0's packed blocks
  int64_t w_expert;     // bytes per expert
  const char* x;        // row 0 of the gathered rows
  int64_t x_row;        // bytes per row
  int64_t xm;           // a row in the kernel's x units (floats, or bf16 pairs)
  int64_t k, np;        // the kernel's k (even for bf16) and padded output columns
  float* y;             // [P][np] fp32 sums
  uint16_t* yb;         // [P][np] bf16 output, or nullptr
};

// Relative cost of one column block of an expert with `rows` rows: its
// weights stream from memory once (about what 16 rows of FMAs take, the
// kernels' register row block) plus its rows' FMAs.
inline int64_t block_cost(int64_t rows) { return kBlockN + rows; }

void run_blocks(const Grouped& g, const std::vector<int64_t>& offset, int64_t e, int64_t lo, int64_t hi) {
  const int64_t rows = offset[e + 1] - offset[e];
  const LinearArgs a{g.w + e * g.w_expert, g.x + offset[e] * g.x_row, nullptr, g.y + offset[e] * g.np,
                     g.yb ? g.yb + offset[e] * g.np : nullptr, nullptr, rows, g.k, g.np, 1, g.xm};
  g.fn(a, lo, hi);
}

// Items (expert, column block) of the experts with rows, in address order,
// cut into one run per thread of about equal cost.
void run_grouped(const Grouped& g, const std::vector<int64_t>& offset) {
  const int64_t e = static_cast<int64_t>(offset.size()) - 1, nb = g.np / kBlockN;
  std::vector<int64_t> experts, start;  // experts with rows; cost before each
  int64_t total = 0;
  for (int64_t l = 0; l < e; ++l) {
    const int64_t rows = offset[l + 1] - offset[l];
    if (rows == 0) continue;
    experts.push_back(l);
    start.push_back(total);
    total += nb * block_cost(rows);
  }
  if (experts.empty()) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / block_cost(1)));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = total * t / threads, c1 = total * (t + 1) / threads;
      for (size_t i = 0; i < experts.size(); ++i) {
        const int64_t l = experts[i], cost = block_cost(offset[l + 1] - offset[l]);
        // Blocks whose start cost lies in [c0, c1).
        const int64_t lo = std::clamp<int64_t>((c0 - start[i] + cost - 1) / cost, 0, nb);
        const int64_t hi = std::clamp<int64_t>((c1 - start[i] + cost - 1) / cost, 0, nb);
        if (lo < hi) run_blocks(g, offset, l, lo, hi);
      }
    }
  });
}

// The packed stack's column blocks and the kernel's k, checked against x.
struct PackedDims {
  int64_t e, nb, k;
};

PackedDims packed_dims(const at::Tensor& w, const at::Tensor& x, int64_t k, const char* what) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == (bf16 ? 5 : 4) &&
                  w.size(3) == kBlockN && (!bf16 || w.size(4) == 2),
              "moe experts: ", what, " must be cpu_linear.pack'ed experts of x's dtype, stacked");
  const int64_t kp = bf16 ? 2 * w.size(2) : w.size(2);
  TORCH_CHECK(kp == k, "moe experts: ", what, " has k ", kp, ", expected ", k, bf16 ? " (even)" : "");
  return {w.size(0), w.size(1), kp};
}

// The GEMM of `xs` (gathered rows [P, k], x's dtype; bf16 as pairs where the
// table has vdpbf16ps, else widened) against the stack `w`: fp32 sums
// [P, np] and, for bf16, the rounded output.
struct GemmOut {
  at::Tensor y, yb;
};

// Which kernel runs a call: a table's, or AMX tiles for bf16 (x padded).
struct Kernel {
  const LinearTable* table;
  bool amx;
};

// AMX tiles read 16 rows at a time: rows past x's last, never stored.
constexpr int64_t kAmxPadRows = 15;

// rows [P, k] copied into a buffer with kAmxPadRows more (uninitialised) rows.
at::Tensor padded_rows(const at::Tensor& rows) {
  at::Tensor out = at::empty({rows.size(0) + kAmxPadRows, rows.size(1)}, rows.options());
  out.narrow(0, 0, rows.size(0)).copy_(rows);
  return out;
}

GemmOut grouped_gemm(const Kernel& kn, const at::Tensor& xs, const at::Tensor& w, const PackedDims& d,
                     const std::vector<int64_t>& offset) {
  const LinearTable* t = kn.table;
  const bool bf16 = xs.scalar_type() == at::kBFloat16, dot = bf16 && (kn.amx || t->bf16_dot != nullptr);
  const at::Tensor x = bf16 && !dot ? xs.to(at::kFloat) : (kn.amx ? padded_rows(xs) : xs.contiguous());
  const int64_t p = xs.size(0), np = d.nb * kBlockN;
  GemmOut out{at::empty({p, np}, x.options().dtype(at::kFloat)), bf16 ? at::empty({p, np}, xs.options()) : at::Tensor()};
  const int64_t elem = x.element_size();
  const LinearFn fn = kn.amx ? conveyor_linear::linear_amx_bf16()
                             : (!bf16 ? t->f32 : (dot ? t->bf16_dot : t->bf16_wide));
  const Grouped g{fn, static_cast<const char*>(w.data_ptr()), w[0].numel() * w.element_size(),
                  static_cast<const char*>(x.data_ptr()), d.k * elem, dot ? d.k / 2 : d.k, d.k, np,
                  out.y.data_ptr<float>(), bf16 ? reinterpret_cast<uint16_t*>(out.yb.data_ptr()) : nullptr};
  run_grouped(g, offset);
  return out;
}

bool amx_ready() {
  static const bool ready = conveyor_linear::linear_amx_bf16() != nullptr && conveyor_linear::amx_request_permission();
  return ready;
}

// "amx": AMX tiles for bf16 whose hidden and intermediate sizes are
// multiples of 32 (else, and for fp32, the best table); any other name: that table.
Kernel kernel_for(const std::string& isa, const at::Tensor& x, int64_t inter) {
  if (isa != "amx") return {conveyor_linear::table_named(isa), false};
  TORCH_CHECK(amx_ready(), "moe experts: this CPU (or this build) cannot run AMX tiles");
  const bool fits = x.scalar_type() == at::kBFloat16 && x.size(1) % 32 == 0 && inter % 32 == 0;
  return {conveyor_linear::table_named("auto"), fits};
}

// out[t] = sum over t's local pairs, ascending expert, of weight * y[pair]
// (y's first h columns, fp32 math: the bf16 output widened), rounded to dtype.
at::Tensor combine(const at::Tensor& y, const at::Tensor& ids, const at::Tensor& weights, const Pairs& p,
                   int64_t h, at::ScalarType dtype) {
  const int64_t t = ids.size(0), k = ids.size(1), ld = y.size(1);
  at::Tensor out = at::zeros({t, h}, y.options().dtype(at::kFloat));
  const at::Tensor yf = y.scalar_type() == at::kFloat ? y : y.to(at::kFloat);
  const float* src = yf.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    std::vector<std::pair<int64_t, int64_t>> mine;  // (expert, pair index) of one token
    for (int64_t r = lo; r < hi; ++r) {
      mine.clear();
      for (int64_t j = 0; j < k; ++j)
        if (p.slot[r * k + j] >= 0) mine.emplace_back(id[r * k + j], r * k + j);
      std::sort(mine.begin(), mine.end());
      float* o = dst + r * h;
      for (const auto& [expert, i] : mine) {
        const float* s = src + p.slot[i] * ld;
        const float wt = w[i];
        for (int64_t c = 0; c < h; ++c) {
          const float v = s[c] * wt;  // rounded, then added: the loop's mul then index_add_
          o[c] += v;
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, int64_t inter,
                   const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t first_expert,
                   c10::string_view isa) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe experts: x must be fp32 or bf16 [T, H]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong &&
                  topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat,
              "moe experts: topk_ids int64 and topk_weights fp32, both [T, k]");
  const int64_t h = x.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat || h % 2 == 0, "moe experts: bf16 needs an even hidden size");
  TORCH_CHECK(x.scalar_type() == at::kFloat || inter % 2 == 0, "moe experts: bf16 needs an even intermediate size");
  const PackedDims d13 = packed_dims(w13, x, h, "w13");
  TORCH_CHECK(inter > 0 && d13.nb == (2 * inter + kBlockN - 1) / kBlockN,
              "moe experts: w13 does not have 2 * inter (", inter, ") output columns");
  const PackedDims d2 = packed_dims(w2, x, inter, "w2");
  TORCH_CHECK(d2.e == d13.e && d2.nb * kBlockN >= h && d2.nb * kBlockN - h < kBlockN,
              "moe experts: w2 does not match w13 (experts) or x (hidden size)");
  const Kernel kn = kernel_for(std::string(isa.data(), isa.size()), x, inter);
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  const Pairs p = sort_pairs(ids, first_expert, d13.e);
  if (p.token.empty()) return at::zeros_like(x);
  const at::Tensor rows = at::from_blob(const_cast<int64_t*>(p.token.data()),
                                        {static_cast<int64_t>(p.token.size())}, at::kLong);
  const at::Tensor xs = x.index_select(0, rows);
  const GemmOut up = grouped_gemm(kn, xs, w13, d13, p.offset);
  const at::Tensor gate_up = x.scalar_type() == at::kFloat ? up.y : up.yb;
  const at::Tensor act = silu_and_mul(gate_up.size(1) == 2 * inter ? gate_up : gate_up.narrow(1, 0, 2 * inter).contiguous());
  const GemmOut down = grouped_gemm(kn, act, w2, d2, p.offset);
  return combine(x.scalar_type() == at::kFloat ? down.y : down.yb, ids, weights, p, h, x.scalar_type());
}
}  // namespace

TORCH_LIBRARY(conveyor_moe, m) {
  m.def("experts(Tensor x, Tensor w13, Tensor w2, int inter, Tensor topk_ids, Tensor topk_weights, int first_expert, "
        "str isa) -> Tensor");
  m.def("amx_ready() -> bool", &amx_ready);
}

TORCH_LIBRARY_IMPL(conveyor_moe, CPU, m) { m.impl("experts", &experts); }
