// DecodeStack's loop (conveyor/workers/models/decode_stack.py) in one native
// call, for steps whose every projection runs the plain kernel: the ops its
// Python loop makes, in the same order on the same tensors, so the results are
// the same bits. What it saves is the Python between ~10 calls per layer.
#include "cpu_ops.h"

namespace {
c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// A RowParallelLinear on one rank: the kernel without bias, then the bias added.
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                         const std::string& isa) {
  torch::Tensor y = conveyor_linear::plain(x, w, c10::nullopt, isa);
  return b.numel() > 0 ? y + b : y;
}
}  // namespace

// hidden [rows, H] (embedded); step: positions, slot_mapping, block table,
// then the attention plan's reqs, starts, q_lens, seq_lens; layers: per layer
// input norm weight, qkv weight, qkv bias, o weight, o bias, post norm weight,
// gate_up weight, gate_up bias, down weight, down bias (empty: no bias), rotary
// cos_sin table, KV cache; dims: query heads, kv heads, head size, rotary head
// size, part_len; consts: input eps, post eps, attention scale (the same for
// every layer). Returns (hidden, residual).
std::vector<torch::Tensor> decode_layers(const torch::Tensor& hidden_in, const std::vector<torch::Tensor>& step,
                                         const std::vector<std::vector<torch::Tensor>>& layers,
                                         const std::vector<int64_t>& dims, const std::vector<double>& consts,
                                         const std::string& isa) {
  TORCH_CHECK(step.size() == 7 && dims.size() == 5 && consts.size() == 3 && !layers.empty(),
              "decode_layers: step has 7 tensors, dims 5, consts 3, and there is a layer");
  const torch::Tensor &positions = step[0], &slots = step[1], &table = step[2];
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], rot = dims[3], part_len = dims[4];
  const int64_t rows = hidden_in.size(0), q_size = hq * d, kv_size = hkv * d;
  torch::Tensor hidden = hidden_in;
  c10::optional<torch::Tensor> residual;
  for (const auto& l : layers) {
    TORCH_CHECK(l.size() == 12, "decode_layers: 12 tensors per layer");
    std::vector<torch::Tensor> n = rms_norm(hidden, residual, l[0], consts[0]);
    residual = n[1];
    const torch::Tensor qkv = conveyor_linear::plain(n[0], l[1], maybe(l[2]), isa);
    const torch::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size),
                        v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_neox(positions, q, k, l[10], rot);
    const torch::Tensor& cache = l[11];
    write_kv(k.view({rows, hkv, d}), v.view({rows, hkv, d}), cache, slots);
    const torch::Tensor q3 = q.view({rows, hq, d}).contiguous();
    torch::Tensor o = torch::empty(q3.sizes(), q3.options());
    paged_attention_short(q3, cache, table, step[3], step[4], step[5], step[6], consts[2], o, part_len);
    n = rms_norm(row_linear(o.view({rows, -1}), l[3], l[4], isa), residual, l[5], consts[1]);
    residual = n[1];
    hidden = row_linear(silu_and_mul(conveyor_linear::plain(n[0], l[6], maybe(l[7]), isa)), l[8], l[9], isa);
  }
  return {hidden, *residual};
}
