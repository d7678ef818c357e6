"""Llama family (Llama 2/3 incl. Llama-3 rope scaling; Mistral uses the same
class). This file also holds the decoder skeleton that Qwen2/Qwen3 reuse:
they override only their quirks (biases, q/k norm) via `attention_cls`.

Module names mirror the HF checkpoint (model.layers.N.self_attn.qkv_proj ...)
so the loader maps names through `packed_modules_mapping` only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.parallel import state
from conveyor.parallel.communication import IntermediateTensors
from conveyor.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from conveyor.workers.forward_context import get_forward_context
from conveyor.workers.layers.activation import SiluAndMul
from conveyor.workers.layers.attention import Attention
from conveyor.workers.layers.layernorm import RMSNorm
from conveyor.workers.layers.rotary import get_rope_from_config
from conveyor.workers.models.decode_stack import DecodeStack
from conveyor.workers.models.utils import PPMissingLayer, get_pp_layer_range, make_layers

logger = logging.getLogger(__name__)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        """intermediate_size: default config.intermediate_size; reduce_results
        False leaves the TP all-reduce to the caller (an MoE block sums its
        shared expert with the routed ones, then reduces once)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias=bias, params_dtype=dtype)
        self.down_proj = RowParallelLinear(i, h, bias=bias, reduce_results=reduce_results, params_dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads,
                                          total_kv, bias=qkv_bias, params_dtype=dtype)
        # Per-rank head counts (kv heads may be replicated when tp > total_kv).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, params_dtype=dtype)
        self.rotary_emb = get_rope_from_config(config, self.head_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads)

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        """(qkv_proj bias, o_proj bias)."""
        b = bool(getattr(config, "attention_bias", False))
        return b, b

    def split_qkv(self, qkv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hook for per-family tweaks of q/k/v before rotary (e.g. Qwen3 q/k norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(self.qkv_proj(hidden_states))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


@dataclass(frozen=True)
class LayerSpec:
    """What a family puts in each decoder layer: its attention class, and its
    MLP (dense, or a mixture of experts) under the checkpoint's module name."""

    attention_cls: type[LlamaAttention]
    make_mlp: Callable[[Any, int, torch.dtype], nn.Module]
    mlp_name: str = "mlp"


class LlamaDecoderLayer(nn.Module):
    _mlp: nn.Module  # the MLP, also registered under spec.mlp_name

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = spec.attention_cls(config, layer_idx, dtype)
        mlp = spec.make_mlp(config, layer_idx, dtype)
        self.add_module(spec.mlp_name, mlp)
        object.__setattr__(self, "_mlp", mlp)  # the same module, not registered twice
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm fuses its add.
        h, residual = self.input_layernorm(hidden_states, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self._mlp(h), residual


def plain_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` is this file's decoder layer as it is: LlamaAttention's
    q/k/v split (a family's q/k norm overrides it) and the dense LlamaMLP."""
    a: Any = getattr(layer, "self_attn", None)
    return (type(layer) is LlamaDecoderLayer and type(a).forward is LlamaAttention.forward
            and type(a).split_qkv is LlamaAttention.split_qkv and type(layer._mlp) is LlamaMLP)


def _warn_sliding_window(config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) \
            and window < config.max_position_embeddings:
        logger.warning("sliding-window attention (window %d) is not implemented: "
                       "outputs differ from the reference beyond %d tokens", window, window)


class LlamaModel(nn.Module):
    """Embedding (first stage) -> this stage's decoder layers -> norm (last stage)."""

    def __init__(self, config: Any, dtype: torch.dtype, spec: LayerSpec,
                 pp_layer_partition: list[int] | None = None) -> None:
        super().__init__()
        self.is_first = state.is_first_pp_rank()
        self.is_last = state.is_last_pp_rank()
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = get_pp_layer_range(
            n, state.pp_rank(), state.pp_size(), pp_layer_partition)
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
            if self.is_first else PPMissingLayer())
        self.layers = make_layers(n, self.start_layer, self.end_layer,
                                  lambda i: LlamaDecoderLayer(config, i, dtype, spec))
        self.norm: nn.Module = (RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
                                if self.is_last else PPMissingLayer())

    def _decode_stack(self) -> DecodeStack | None:
        """Built at the first step that has KV caches, then kept (None: this
        model runs every step through its modules)."""
        if "_stack" not in self.__dict__:
            ctx = get_forward_context()
            layers: list[Any] = list(self.layers[self.start_layer:self.end_layer])
            if not all(map(plain_layer, layers)):
                self.__dict__["_stack"] = None
            elif ctx is None or ctx.attn_metadata is None or any(l.self_attn.attn.kv_cache is None for l in layers):
                return None  # a profiling run: no caches yet
            else:
                self.__dict__["_stack"] = DecodeStack.build(layers, self.embed_tokens, self.norm)
        return self.__dict__["_stack"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """inputs_embeds (first stage): used instead of embedding input_ids
        (a vision-language model has put image features in them). Small
        decode steps run through DecodeStack where it covers the model."""
        if self.is_first and self.is_last and inputs_embeds is None:
            stack, ctx = self._decode_stack(), get_forward_context()
            if stack is not None and stack.covers(input_ids.shape[0], ctx):
                return stack.run(input_ids, positions, ctx)
        if self.is_first:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError("a non-first PP stage needs intermediate_tensors")
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last:
            assert residual is not None  # every stage holds at least one layer
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # HF checkpoint module name -> (our fused module, shard id of its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # Checkpoint names of one expert's tensors -> (our stacked parameter, part):
    # "model.layers.L.<mlp>.experts.E.<name>.weight" (mixtures of experts only).
    expert_checkpoint_names: dict[str, tuple[str, int | None]] = {}

    def __init__(self, hf_config: Any, dtype: torch.dtype,
                 pp_layer_partition: list[int] | None = None, expert_parallel: bool = False) -> None:
        super().__init__()
        _warn_sliding_window(hf_config)
        self.config = hf_config
        self.expert_parallel = expert_parallel
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, dtype, self.layer_spec(), pp_layer_partition)
        self.lm_head: ParallelLMHead | PPMissingLayer = PPMissingLayer()
        if self.model.is_last:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
            if self.tie_word_embeddings and self.model.is_first:
                # One Parameter for both; with PP the last stage keeps its own
                # copy, which the loader fills from model.embed_tokens.weight.
                emb = self.model.embed_tokens
                assert isinstance(emb, VocabParallelEmbedding)  # the first stage embeds
                self.lm_head.weight = emb.weight

    def layer_spec(self) -> LayerSpec:
        return LayerSpec(self.attention_cls, lambda config, i, dtype: LlamaMLP(config, dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids/positions [T] -> final hidden states [T, hidden] on the
        last PP stage, IntermediateTensors elsewhere."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 [N, vocab_size] (last PP stage, every TP rank)."""
        if not self.model.is_last:
            raise RuntimeError("compute_logits called on a non-last PP stage")
        assert isinstance(self.lm_head, ParallelLMHead)  # the last stage has one
        return self.lm_head.get_logits(hidden_states).float()


# Mistral's architecture is Llama's (its sliding window, if set, is not modelled).
MistralForCausalLM = LlamaForCausalLM
