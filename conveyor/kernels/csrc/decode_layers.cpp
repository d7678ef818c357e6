// A decode step of DecodeStack (conveyor/workers/models/decode_stack.py) in one
// native call: the ops the modules make, in their order on the same tensors,
// so the results are the same bits. What it saves is the Python between ~10
// calls per layer.
#include "cpu_ops.h"

namespace {
c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// Where a projection's rows go, as conveyor.parallel.layers.linear and
// quant.int8_linear route them: int8 up to int8_rows on the int8 kernel, above
// on the prefill-sized op; float on the plain kernel, or on the packed one
// where the step passed the layer's packed copy.
struct Route {
  int64_t int8_rows;
  const std::string& isa;
};

// One projection from its three tensors at p: the weight and no scale (float),
// or pack(q) and its scales (int8); then the bias, empty for none; `packed`
// the packed copy, empty for none. A RowParallelLinear (row) takes its bias
// after the kernel, as its forward adds it after the (one-rank) all-reduce.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor* p, const torch::Tensor& packed, bool row,
                      const Route& r) {
  const c10::optional<torch::Tensor> bias = row ? c10::nullopt : maybe(p[2]);
  torch::Tensor y;
  if (p[1].numel() > 0)
    y = x.size(0) <= r.int8_rows ? conveyor_linear::int8(x, p[0], p[1], bias, r.isa)
                                 : conveyor_linear::int8_rows(x, p[0], p[1], bias, r.isa);
  else
    y = packed.numel() > 0 ? conveyor_linear::packed(x, packed, p[0].size(0), bias, r.isa)
                           : conveyor_linear::plain(x, p[0], bias, r.isa);
  return row && p[2].numel() > 0 ? y + p[2] : y;
}
}  // namespace

// input_ids [rows] (int64) and the embedding table; step: positions,
// slot_mapping, block table, then the attention plan's reqs, starts, q_lens,
// seq_lens; layers: per layer the input norm weight, then qkv, o, gate_up and
// down as three tensors each (see project), the post-attention norm weight,
// the rotary cos_sin table, the KV cache, and the four projections' packed
// copies (20); final_norm: the model's norm weight; dims: query heads, kv
// heads, head size, rotary head size, part_len, the int8 kernel's rows;
// consts: input eps, post eps, attention scale (every layer's), final norm
// eps. Returns the final norm's output, as LlamaModel.forward does: embedding
// and final norm are in the call because, after the layers have streamed the
// weights through the caches, each was a cold Python op (the final norm's
// module call cost 44 us at batch 1, 30M).
torch::Tensor decode_layers(const torch::Tensor& input_ids, const torch::Tensor& embed,
                            const std::vector<torch::Tensor>& step,
                            const std::vector<std::vector<torch::Tensor>>& layers, const torch::Tensor& final_norm,
                            const std::vector<int64_t>& dims, const std::vector<double>& consts,
                            const std::string& isa) {
  TORCH_CHECK(step.size() == 7 && dims.size() == 6 && consts.size() == 4 && !layers.empty(),
              "decode_layers: step has 7 tensors, dims 6, consts 4, and there is a layer");
  const torch::Tensor &positions = step[0], &slots = step[1], &table = step[2];
  const int64_t hq = dims[0], hkv = dims[1], d = dims[2], rot = dims[3], part_len = dims[4];
  const int64_t rows = input_ids.size(0), q_size = hq * d, kv_size = hkv * d;
  const Route route{dims[5], isa};
  torch::Tensor hidden = at::embedding(embed, input_ids);  // F.embedding's op
  c10::optional<torch::Tensor> residual;
  for (const auto& l : layers) {
    TORCH_CHECK(l.size() == 20, "decode_layers: 20 tensors per layer");
    std::vector<torch::Tensor> n = rms_norm(hidden, residual, l[0], consts[0]);
    residual = n[1];
    const torch::Tensor qkv = project(n[0], &l[1], l[16], false, route);
    const torch::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size),
                        v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_neox(positions, q, k, l[14], rot);
    const torch::Tensor& cache = l[15];
    write_kv(k.view({rows, hkv, d}), v.view({rows, hkv, d}), cache, slots);
    const torch::Tensor q3 = q.view({rows, hq, d}).contiguous();
    torch::Tensor o = torch::empty(q3.sizes(), q3.options());
    paged_attention_short(q3, cache, table, step[3], step[4], step[5], step[6], consts[2], o, part_len);
    n = rms_norm(project(o.view({rows, -1}), &l[4], l[17], true, route), residual, l[13], consts[1]);
    residual = n[1];
    hidden = project(silu_and_mul(project(n[0], &l[7], l[18], false, route)), &l[10], l[19], true, route);
  }
  return rms_norm(hidden, residual, final_norm, consts[3])[0];
}
