"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention, and in each layer
either a mixture of experts or a dense MLP: layer i is sparse unless it is in
`mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0. The router is
softmax over all experts in fp32, top-k, renormalised only with
`norm_topk_prob`, the weights then in the model's dtype (transformers'
Qwen*MoeTopKRouter). Qwen2-MoE adds a shared expert to every sparse layer,
scaled by sigmoid(shared_expert_gate(x))."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.parallel import state
from conveyor.workers.layers.moe import FusedMoE, RouterGate, moe_shape, route_topk
from conveyor.workers.models.llama import LayerSpec, LlamaForCausalLM, LlamaMLP
from conveyor.workers.models.qwen2 import Qwen2Attention
from conveyor.workers.models.qwen3 import Qwen3Attention

QWEN_EXPERT_NAMES: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer_idx + 1) % step == 0)


class QwenSparseMoeBlock(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, expert_parallel: bool) -> None:
        super().__init__()
        shape = moe_shape(config, int(config.num_experts), int(config.moe_intermediate_size))
        self.top_k, self.renormalize = shape.top_k, bool(getattr(config, "norm_topk_prob", False))
        self.gate = RouterGate(shape.hidden_size, shape.num_experts, dtype)
        self.experts = FusedMoE(shape, dtype, expert_parallel)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        # A dense gated MLP; the block reduces it with the routed experts.
        self.shared_expert = LlamaMLP(config, dtype, shared, reduce_results=False) if shared else None
        self.shared_expert_gate = RouterGate(shape.hidden_size, 1, dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        # transformers rounds the weights to the model's dtype before use.
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        # Routed and shared partial sums of every rank: one reduction for both.
        return state.tp_all_reduce(out)


class _QwenMoeForCausalLM(LlamaForCausalLM):
    expert_checkpoint_names = QWEN_EXPERT_NAMES

    def layer_spec(self) -> LayerSpec:
        ep = self.expert_parallel

        def make_mlp(config: Any, i: int, dtype: torch.dtype) -> nn.Module:
            if is_sparse_layer(config, i):
                return QwenSparseMoeBlock(config, dtype, ep)
            return LlamaMLP(config, dtype)  # intermediate_size, like any dense layer
        return LayerSpec(self.attention_cls, make_mlp)


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    attention_cls = Qwen2MoeAttention


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    attention_cls = Qwen3Attention
