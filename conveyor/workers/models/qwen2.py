"""Qwen2: Llama with a bias on q/k/v (not on o_proj); tied embeddings when the
config says so (handled by the shared LlamaForCausalLM)."""
from __future__ import annotations

from typing import Any

from conveyor.workers.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
