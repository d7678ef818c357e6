"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): the vision
tower of qwen2_5_vl_vision.py, and a Qwen2 decoder whose rotary embedding is
M-RoPE.

M-RoPE: every position is a triple (t, h, w). The rotary frequencies are
split into `mrope_section` bands [t | h | w] (summing to head_dim / 2), each
band rotated by its own coordinate. A text token's triple is (p, p, p), which
is the plain rotary embedding. An image's placeholder tokens take
(start, start + row, start + column) over its merged grid (start = the
position after the preceding text); the text after the image goes on from
start + max(rows, columns). So past an image a request's positions run ahead
of (or behind) its token index by a constant `delta`; decode tokens sit at
index + delta. `mrope_positions` computes a prompt's triples and delta
(conveyor/workers/mrope.py: transformers' get_rope_index); the runner passes
[3, T] positions (conveyor/workers/mm_encoder.py).
"""
from __future__ import annotations

from typing import Any

import torch

from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.parallel import state
from conveyor.workers.layers.rotary import RotaryEmbedding, rope_params_from_config
from conveyor.workers.models.llama import LlamaForCausalLM
from conveyor.workers.models.qwen2 import Qwen2Attention
from conveyor.workers.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, QwenVisionConfig
from conveyor.workers.models.utils import PPMissingLayer


def mrope_section(hf_config: Any) -> list[int]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return [int(x) for x in params.get("mrope_section", [16, 24, 24])]


class MRotaryEmbedding(RotaryEmbedding):
    """positions [T] (text only: the plain rotary) or [3, T] (t, h, w rows)."""

    def __init__(self, head_size: int, max_position: int, base: float, section: list[int]) -> None:
        super().__init__(head_size, head_size, max_position, base)
        if sum(section) != head_size // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_size // 2}")
        self.section = section

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # each [3, T, D/2]
        bands = [(sum(self.section[:i]), s) for i, s in enumerate(self.section)]
        cos = torch.cat([cos[i % 3, :, a:a + s] for i, (a, s) in enumerate(bands)], dim=-1)
        sin = torch.cat([sin[i % 3, :, a:a + s] for i, (a, s) in enumerate(bands)], dim=-1)
        cos, sin = cos.to(query.dtype).unsqueeze(1), sin.to(query.dtype).unsqueeze(1)
        return self._rotate_heads(query, cos, sin), self._rotate_heads(key, cos, sin)


class Qwen2_5_VLAttention(Qwen2Attention):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(config, layer_idx, dtype)
        base, _, _ = rope_params_from_config(config)
        self.rotary_emb = MRotaryEmbedding(self.head_dim, config.max_position_embeddings, base,
                                           mrope_section(config))


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    attention_cls = Qwen2_5_VLAttention
    supports_images = True
    uses_mrope = True
    checkpoint_prefixes: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )

    def __init__(self, hf_config: Any, dtype: torch.dtype,
                 pp_layer_partition: list[int] | None = None, expert_parallel: bool = False) -> None:
        if state.pp_size() > 1:  # later stages would need the [3, T] positions too
            raise ValueError("Qwen2.5-VL with pipeline parallelism is not supported (M-RoPE positions "
                             "reach the first stage only); use tensor parallelism")
        super().__init__(hf_config, dtype, pp_layer_partition, expert_parallel)
        self.vision = QwenVisionConfig(getattr(hf_config, "vision_config", None))
        self.image_token_id = int(hf_config.image_token_id)
        self.visual: torch.nn.Module = PPMissingLayer()
        if self.model.is_first:
            self.visual = Qwen2_5_VisionTransformer(self.vision, dtype)

    def encode_images(self, pixels: list[torch.Tensor], features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's patch rows -> its placeholder rows (one image at a time)."""
        tower = self.visual
        assert isinstance(tower, Qwen2_5_VisionTransformer)  # only the first stage encodes
        out = []
        for px, f in zip(pixels, features):
            assert f.grid_thw is not None
            t, h, w = f.grid_thw
            out.append(tower(px, (t, h, w)))
        return out

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)
