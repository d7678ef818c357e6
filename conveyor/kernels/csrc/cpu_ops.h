// The extension's torch-facing ops that other sources call directly (defined
// in paged_attention_cpu.cpp and linear_cpu.cpp; their contracts are there).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

void paged_attention_short(const torch::Tensor& query, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_table, const torch::Tensor& reqs,
                           const torch::Tensor& starts, const torch::Tensor& q_lens,
                           const torch::Tensor& seq_lens, double scale, torch::Tensor out,
                           int64_t part_len);
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor cache,
              const torch::Tensor& slot_mapping);
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                    const torch::Tensor& weight, double eps);
void rotary_neox(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                 const torch::Tensor& cos_sin, int64_t head_size);
torch::Tensor silu_and_mul(const torch::Tensor& x);

namespace conveyor_linear {
// The plain small-M kernel (conveyor_linear::linear_plain) without the dispatcher.
at::Tensor plain(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                 const std::string& isa);
// The packed small-M kernel (conveyor_linear::linear) on pack(w), n = w's rows.
at::Tensor packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  const std::string& isa);
// The int8 small-M kernel (conveyor_linear::linear_i8) on pack(q), n = scale's length.
at::Tensor int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                const c10::optional<at::Tensor>& bias, const std::string& isa);
// Past the int8 kernel's rows (conveyor_linear::linear_i8_tiled), n = scale's length.
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, const std::string& isa);
}  // namespace conveyor_linear

torch::Tensor decode_layers(const torch::Tensor& input_ids, const torch::Tensor& embed,
                            const std::vector<torch::Tensor>& step,
                            const std::vector<std::vector<torch::Tensor>>& layers, const torch::Tensor& final_norm,
                            const std::vector<int64_t>& dims, const std::vector<double>& consts,
                            const std::string& isa);
