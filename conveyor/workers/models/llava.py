"""LLaVA (transformers' LlavaForConditionalGeneration): a CLIP vision tower,
the multimodal projector (linear, activation, linear) and a Llama decoder.

An image becomes `num_image_tokens` embeddings: the tower's hidden states at
`vision_feature_layer` (one layer, or several concatenated on the feature
axis), without the CLS position when `vision_feature_select_strategy` is
"default", through the projector. The runner writes them over the image's
placeholder tokens in the decoder's input embeddings
(conveyor/workers/mm_encoder.py); everything after that is the text model's.

Checkpoints name the decoder "language_model.model." (transformers < 5 and
the Hub's llava-hf) or "model.language_model."; the tower sits under
"vision_tower." or "model.vision_tower.", with or without "vision_model.".
`checkpoint_prefixes` maps every spelling onto our module tree.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.parallel.layers import ColumnParallelLinear, RowParallelLinear
from conveyor.workers.models.clip import CLIPVisionTransformer, VisionConfig, activation
from conveyor.workers.models.llama import LlamaForCausalLM
from conveyor.workers.models.utils import PPMissingLayer


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_features, hidden, bias=bias, params_dtype=dtype)
        self.act = activation(act)
        self.linear_2 = RowParallelLinear(hidden, hidden, bias=bias, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def feature_layers(hf_config: Any) -> list[int]:
    layer = hf_config.vision_feature_layer
    return [int(layer)] if isinstance(layer, int) else [int(x) for x in layer]


class LlavaForConditionalGeneration(LlamaForCausalLM):
    supports_images = True
    checkpoint_prefixes: tuple[tuple[str, str], ...] = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, hf_config: Any, dtype: torch.dtype,
                 pp_layer_partition: list[int] | None = None, expert_parallel: bool = False) -> None:
        super().__init__(hf_config, dtype, pp_layer_partition, expert_parallel)
        vision = VisionConfig(getattr(hf_config, "vision_config", None))
        strategy = hf_config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r} (default or full)")
        self.drop_cls = strategy == "default"
        self.feature_layers = feature_layers(hf_config)
        self.image_token_id = int(hf_config.image_token_index)
        # Only the first pipeline stage embeds: it alone holds the image encoder.
        self.vision_tower: nn.Module = PPMissingLayer()
        self.multi_modal_projector: nn.Module = PPMissingLayer()
        if self.model.is_first:
            self.vision_tower = CLIPVisionTransformer(vision, dtype)
            self.multi_modal_projector = LlavaMultiModalProjector(
                vision.hidden_size * len(self.feature_layers), hf_config.hidden_size,
                hf_config.projector_hidden_act, bool(hf_config.multimodal_projector_bias), dtype)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] pixels (the HF processor's) -> [B, tokens per image, hidden]."""
        tower = self.vision_tower
        assert isinstance(tower, CLIPVisionTransformer)  # only the first stage embeds
        states = tower.hidden_states(pixel_values, self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        feats = torch.cat(states, dim=-1)
        b, n, d = feats.shape
        return self.multi_modal_projector(feats.reshape(b * n, d)).view(b, n, -1)

    def encode_images(self, pixels: list[torch.Tensor], features: list[Any]) -> list[torch.Tensor]:
        """Each image's pixels -> its placeholder rows (images of one shape in one batch)."""
        out: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixels):
            by_shape.setdefault(tuple(px.shape), []).append(i)
        for idx in by_shape.values():
            rows = self.embed_images(torch.stack([pixels[i] for i in idx]))
            for i, r in zip(idx, rows):
                out[i] = r
        return [r for r in out if r is not None]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)
