"""Model registry: HF `architectures[0]` -> our model class (imported lazily)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.workers.models.llama import LlamaForCausalLM

# architecture name -> (module under conveyor.workers.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """Every model class derives from LlamaForCausalLM (the shared skeleton)."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in _MODELS:
        raise ValueError(f"unsupported model architecture {archs[:1] or None}; "
                         f"supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[archs[0]]
    return getattr(importlib.import_module(f"conveyor.workers.models.{module}"), name)
