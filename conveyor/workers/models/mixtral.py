"""Mixtral: Mistral's attention and a mixture of experts in every layer
(`block_sparse_moe`): softmax over all experts in fp32, top-k, the k weights
renormalised to sum to 1 (transformers' MixtralTopKRouter)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.parallel import state
from conveyor.workers.layers.moe import FusedMoE, RouterGate, moe_shape, route_topk
from conveyor.workers.models.llama import LayerSpec, LlamaForCausalLM


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, expert_parallel: bool) -> None:
        super().__init__()
        shape = moe_shape(config, int(config.num_local_experts), int(config.intermediate_size))
        self.top_k = shape.top_k
        self.gate = RouterGate(shape.hidden_size, shape.num_experts, dtype)
        self.experts = FusedMoE(shape, dtype, expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, renormalize=True)
        # Each rank holds its experts (or its slice of every expert): the sum is the layer.
        return state.tp_all_reduce(self.experts(x, weights, ids))


class MixtralForCausalLM(LlamaForCausalLM):
    expert_checkpoint_names = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None)}

    def layer_spec(self) -> LayerSpec:
        ep = self.expert_parallel
        return LayerSpec(self.attention_cls, lambda config, i, dtype: MixtralSparseMoeBlock(config, dtype, ep),
                         mlp_name="block_sparse_moe")
