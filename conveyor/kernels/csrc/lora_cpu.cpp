// The multi-LoRA CPU op: torch.ops.conveyor_lora.lora_add (registered with the
// dispatcher, so the attention glue's pybind module needs no change).
//
//   lora_add(x [T, K], y [T, *] (in place), a_t [S + 1, K, n_sub * R],
//            bs: n_sub x [S + 1, R, N_i], offsets: n_sub ints (y columns),
//            rows int64 [n] (tokens grouped by slot), segs int64 [G, 3]
//            (start, end, slot) over rows, isa)
// adds, for each segment and each of its rows t, (x[t] @ a_t[slot])[sub i] @
// bs[i][slot] into y[t, offsets[i]:offsets[i] + N_i]. fp32 only; the caller
// (conveyor/workers/lora/mapping.py) keeps the torch path for anything else.
//
// Segments are cut into chunks of rows; chunks run in parallel (at::parallel_for)
// and never share a row, so their writes to y never overlap.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "lora_kernels.h"

namespace {
using conveyor_lora::LoraArgs;
using conveyor_lora::LoraRowsFn;

constexpr int64_t kChunkRows = 16;  // rows per parallel work item (A, B re-read per chunk)

LoraRowsFn pick(const std::string& isa) {
  if ((isa == "avx512" || isa == "auto") && conveyor_cpu::cpu_runs("avx512") && conveyor_lora::lora_rows_avx512())
    return conveyor_lora::lora_rows_avx512();
  if ((isa == "avx2" || isa == "auto") && conveyor_cpu::cpu_runs("avx2") && conveyor_lora::lora_rows_avx2())
    return conveyor_lora::lora_rows_avx2();
  TORCH_CHECK(isa == "portable" || isa == "auto", "LoRA kernel ISA '", isa, "' is not supported on this CPU");
  return conveyor_lora::lora_rows_portable();
}

void check_args(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a_t, const std::vector<at::Tensor>& bs,
                const std::vector<int64_t>& offsets, const at::Tensor& rows, const at::Tensor& segs) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x and y must be [T, *]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a_t.scalar_type() == at::kFloat,
              "lora_add: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add: x and y columns must be contiguous");
  TORCH_CHECK(a_t.dim() == 3 && a_t.is_contiguous() && a_t.size(1) == x.size(1), "lora_add: a_t must be [S, K, nR]");
  const int64_t n_sub = static_cast<int64_t>(bs.size());
  TORCH_CHECK(n_sub >= 1 && n_sub <= conveyor_lora::kMaxSubs && offsets.size() == bs.size(),
              "lora_add: 1 to 3 sub-projections, one offset each");
  TORCH_CHECK(a_t.size(2) % n_sub == 0, "lora_add: a_t's columns must split evenly over the sub-projections");
  for (int64_t i = 0; i < n_sub; ++i) {
    const at::Tensor& b = bs[i];
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 3 && b.is_contiguous() && b.size(0) == a_t.size(0) &&
                    b.size(1) == a_t.size(2) / n_sub,
                "lora_add: bs[", i, "] must be [S, R, N] fp32 contiguous");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + b.size(2) <= y.size(1), "lora_add: bs[", i, "] past y's columns");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "lora_add: rows int64 [n]");
  TORCH_CHECK(segs.scalar_type() == at::kLong && segs.dim() == 2 && segs.size(1) == 3 && segs.is_contiguous(),
              "lora_add: segs int64 [G, 3]");
}

struct Chunk {
  int64_t start, count, slot;
};

// Chunks of every segment, bounds checked once here.
std::vector<Chunk> chunks_of(const at::Tensor& segs, int64_t n_rows, int64_t num_slots) {
  std::vector<Chunk> out;
  const int64_t* sg = segs.data_ptr<int64_t>();
  for (int64_t g = 0; g < segs.size(0); ++g) {
    const int64_t start = sg[3 * g], end = sg[3 * g + 1], slot = sg[3 * g + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= n_rows && 0 <= slot && slot < num_slots,
                "lora_add: segment ", g, " out of range");
    for (int64_t s = start; s < end; s += kChunkRows) out.push_back({s, std::min(kChunkRows, end - s), slot});
  }
  return out;
}

void lora_add(const at::Tensor& x, at::Tensor& y, const at::Tensor& a_t, at::TensorList bs_list,
              at::IntArrayRef offsets_ref, const at::Tensor& rows, const at::Tensor& segs, c10::string_view isa) {
  const std::vector<at::Tensor> bs(bs_list.begin(), bs_list.end());
  const std::vector<int64_t> offsets(offsets_ref.begin(), offsets_ref.end());
  check_args(x, y, a_t, bs, offsets, rows, segs);
  const LoraRowsFn fn = pick(std::string(isa.data(), isa.size()));
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) TORCH_CHECK(rw[j] >= 0 && rw[j] < x.size(0), "lora_add: row out of range");
  const std::vector<Chunk> chunks = chunks_of(segs, rows.size(0), a_t.size(0));
  LoraArgs base{};
  base.x = x.data_ptr<float>();
  base.y = y.data_ptr<float>();
  base.x_stride = x.stride(0);
  base.y_stride = y.stride(0);
  base.k = a_t.size(1);
  base.nr = a_t.size(2);
  base.n_sub = static_cast<int>(bs.size());
  base.rank = base.nr / base.n_sub;
  for (int i = 0; i < base.n_sub; ++i) {
    base.n[i] = bs[i].size(2);
    base.off[i] = offsets[i];
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(conveyor_lora::kRowBlock * base.nr);
    for (int64_t c = lo; c < hi; ++c) {
      LoraArgs p = base;
      const Chunk& ch = chunks[c];
      p.a = a_t.data_ptr<float>() + ch.slot * base.k * base.nr;
      for (int i = 0; i < p.n_sub; ++i) p.b[i] = bs[i].data_ptr<float>() + ch.slot * p.rank * p.n[i];
      fn(p, rw + ch.start, ch.count, scratch.data());
    }
  });
}

std::vector<std::string> lora_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"avx512", "avx2"})
    if (conveyor_cpu::cpu_runs(isa) && (std::string(isa) == "avx512" ? conveyor_lora::lora_rows_avx512() != nullptr
                                                      : conveyor_lora::lora_rows_avx2() != nullptr))
      out.emplace_back(isa);
  out.emplace_back("portable");
  return out;
}
}  // namespace

TORCH_LIBRARY(conveyor_lora, m) {
  m.def("lora_add(Tensor x, Tensor(a!) y, Tensor a_t, Tensor[] bs, int[] offsets, Tensor rows, Tensor segs, "
        "str isa) -> ()");
  m.def("supported_isas() -> str[]", &lora_isas);
}

TORCH_LIBRARY_IMPL(conveyor_lora, CPU, m) { m.impl("lora_add", &lora_add); }
