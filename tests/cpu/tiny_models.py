"""Tiny random-weight HF checkpoints for tests (no downloads).

    make_tiny_model("llama", tmp_path / "m")                 -> the directory
    make_tiny_model("qwen2", d, num_hidden_layers=3, max_shard_size="40KB")

Families: llama, llama3 (Llama-3 rope scaling), mistral, qwen2, qwen2-tied
(tie_word_embeddings=True), qwen3, and the mixtures of experts mixtral,
qwen2-moe (a shared expert, layer 0 dense by decoder_sparse_step 2, top-k not
renormalised) and qwen3-moe (q/k norm, layer 1 dense by mlp_only_layers,
norm_topk_prob). Keyword overrides go into the config, except
`max_shard_size` (saves a sharded checkpoint with an index) and `seed`.
Weights are deterministic for a given (family, overrides, seed).
"""
from __future__ import annotations

import os
from typing import Any

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    max_position_embeddings=1024, initializer_range=0.05, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}

# family -> (transformers config class, extra config kwargs)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "sliding_window": None}),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
                                     "decoder_sparse_step": 2, "mlp_only_layers": []}),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
}
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")

FAMILIES = tuple(_FAMILIES)


def tiny_config(family: str, **overrides: Any) -> Any:
    import transformers
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    cls_name, extra = _FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_model(family: str, path: str | os.PathLike, **overrides: Any) -> str:
    """Write a random-weight fp32 checkpoint (config, safetensors, generation
    config) for `family` into `path` and return `path` as a str."""
    import torch
    from transformers import AutoModelForCausalLM

    max_shard_size = overrides.pop("max_shard_size", None)
    seed = overrides.pop("seed", 0)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_defaults(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def _randomize_defaults(model: Any) -> None:
    """HF initialises norm weights to 1 and biases to 0; randomise them so a
    test notices a norm or bias that is loaded into the wrong place."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight") and p.shape[0] <= 16:
                # A router (or Qwen2-MoE's shared-expert gate), zero-initialised by
                # transformers: wide logits, so no two experts tie for top-k.
                p.copy_(torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
