"""A checkpoint's config.json as the attributes the model classes read, with
the defaults of transformers' config class for its ``model_type``.

Why not ``transformers.AutoConfig``: importing transformers' configuration
code pulls in its model-loading, kernel-hub and torch.distributed.tensor
modules, about 2 CPU-seconds in every rank process that only needs a dozen
numbers (a 2x2 engine starts four). The engine side already reads config.json
directly (conveyor/engine/lora.py, conveyor/engine/frontend/tokenizer.py). The defaults below are those
of transformers' LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config for
the fields the models read; tests/cpu/integration/test_models.py compares every field
with AutoConfig for each family, so a drift in transformers shows there.
"""
from __future__ import annotations

import json
import os
from typing import Any

# Defaults every supported family shares.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0,
    "num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096,
}

# model_type -> the defaults of its transformers config class that differ from _COMMON.
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "sliding_window": None, "use_sliding_window": False},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
              "num_key_value_heads": 32, "sliding_window": None, "use_sliding_window": False,
              "head_dim": 128},
    # Mixtures of experts (conveyor/workers/models/mixtral.py, qwen_moe.py).
    "mixtral": {"vocab_size": 32000, "intermediate_size": 14336, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "sliding_window": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"vocab_size": 151936, "intermediate_size": 5632, "max_position_embeddings": 32768,
                  "num_key_value_heads": 16, "sliding_window": None, "use_sliding_window": False,
                  "num_attention_heads": 16, "num_hidden_layers": 24, "hidden_size": 2048,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True},
    "qwen3_moe": {"vocab_size": 151936, "intermediate_size": 6144, "max_position_embeddings": 32768,
                  "num_key_value_heads": 4, "sliding_window": None, "use_sliding_window": False,
                  "num_hidden_layers": 24, "hidden_size": 2048,
                  "num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
# model_type -> (name, alias): transformers reads either key as one attribute
# (its attribute_map); config.json may hold either, depending on its writer.
_ALIASES: dict[str, tuple[str, str]] = {"mixtral": ("num_local_experts", "num_experts"),
                                        "qwen3_moe": ("num_local_experts", "num_experts")}
# Families whose config keeps sliding_window only when use_sliding_window is set.
_WINDOW_SWITCHED = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
# Vision-language families: model_type -> (defaults of their own keys, default
# text model_type). Their text_config's keys are lifted to the top (the decoder
# reads them as any text model's); the top level's own keys win.
_NESTED: dict[str, tuple[dict[str, Any], str]] = {
    "llava": ({"image_token_index": 32000, "projector_hidden_act": "gelu",
               "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
               "multimodal_projector_bias": True, "image_seq_length": 576}, "llama"),
    "qwen2_5_vl": ({"image_token_id": 151655, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                    "vocab_size": 152064}, "qwen2"),
}


def _lift_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    own, text_type = _NESTED[str(raw.get("model_type"))]
    text = dict(raw.get("text_config") or {})
    if text.get("model_type") in _FAMILIES:
        text_type = str(text["model_type"])
    top = {k: v for k, v in raw.items() if k != "text_config"}
    out = {**_COMMON, **_FAMILIES[text_type], **own, **text, **top, "text_model_type": text_type}
    for key in ("rope_parameters", "rope_scaling"):  # M-RoPE's bands rotate with the default frequencies
        rope = out.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "mrope":
            out[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return out


class HFConfig:
    """Read-only attributes: config.json's keys over the family defaults.
    A key neither holds raises AttributeError, so ``getattr(c, k, default)``
    behaves as it does on a transformers config."""

    def __init__(self, raw: dict[str, Any]) -> None:
        if raw.get("model_type") in _NESTED:
            raw = _lift_text_config(raw)
        model_type = str(raw.get("text_model_type", raw.get("model_type")))
        # Another family gets the shared defaults only: the model registry
        # (conveyor.workers.models.get_model_class) refuses its architecture anyway.
        values = {**_COMMON, **_FAMILIES.get(model_type, {}), **raw}
        if model_type in _ALIASES:
            a, b = _ALIASES[model_type]
            given = raw.get(a, raw.get(b))
            if given is not None:
                values[a] = values[b] = given
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if model_type in _WINDOW_SWITCHED and not values.get("use_sliding_window"):
            values["sliding_window"] = None
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"HFConfig({self._values.get('model_type')!r}, {len(self._values)} keys)"


def read_hf_config(model_dir: str) -> HFConfig:
    """The HFConfig of a local checkpoint directory (never downloads)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return HFConfig(json.load(f))
