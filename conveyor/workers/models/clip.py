"""CLIP's vision tower (the image encoder of LLaVA), on our TP layers.

Module names mirror transformers' CLIPVisionTransformer (embeddings,
pre_layrnorm, encoder.layers.N.{self_attn.{q,k,v,out}_proj, mlp.fc1/fc2,
layer_norm1/2}, post_layernorm) so the loader maps checkpoint names through
`packed_modules_mapping` only (q/k/v fuse into qkv_proj as in the decoder).
Heads and the MLP are split over the TP ranks; every rank runs the tower on
the same pixels, so each ends with the same (all-reduced) features.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.parallel.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class VisionConfig:
    """A vision_config mapping with the defaults of transformers' CLIPVisionConfig."""

    _DEFAULTS: dict[str, Any] = {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
        "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}

    def __init__(self, raw: dict[str, Any] | None) -> None:
        values = {**self._DEFAULTS, **(raw or {})}
        self.hidden_size = int(values["hidden_size"])
        self.intermediate_size = int(values["intermediate_size"])
        self.num_hidden_layers = int(values["num_hidden_layers"])
        self.num_attention_heads = int(values["num_attention_heads"])
        self.num_channels = int(values["num_channels"])
        self.image_size = int(values["image_size"])
        self.patch_size = int(values["patch_size"])
        self.hidden_act = str(values["hidden_act"])
        self.layer_norm_eps = float(values["layer_norm_eps"])


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return fn


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.image_size, self.patch_size = cfg.image_size, p
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, p, stride=p, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding((cfg.image_size // p) ** 2 + 1, d, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] (H = W = image_size) -> [B, 1 + patches, hidden]."""
        b, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"image of {h}x{w} pixels; the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(b, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, heads, heads, bias=True,
                                          params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] -> [B, S, hidden]: full (bidirectional) attention within each image."""
        b, s, _ = x.shape
        qkv = self.qkv_proj(x.reshape(b * s, -1)).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim))
        return self.out_proj(o.transpose(1, 2).reshape(b * s, -1)).view(b, s, -1)


class CLIPMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, params_dtype=dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1])))).view(shape)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.self_attn = CLIPAttention(cfg, dtype)
        self.layer_norm1 = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = CLIPMLP(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class CLIPVisionTransformer(nn.Module):
    """pixels -> the hidden states after the layers a caller selects."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = CLIPVisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(cfg, dtype)
        # Loaded (the checkpoint has it) but unused: LLaVA reads inner layers.
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def hidden_states(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """transformers' hidden_states[i] for each i in `layers` (0: the
        embeddings after pre_layrnorm, k: after encoder layer k; negative i
        counts from num_hidden_layers + 1). Layers past the deepest one asked
        for are not run."""
        n = self.config.num_hidden_layers
        wanted = [i % (n + 1) for i in layers]
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: h}
        for k, layer in enumerate(self.encoder.layers[:max(wanted)], start=1):
            h = layer(h)
            states[k] = h
        return [states[i] for i in wanted]
