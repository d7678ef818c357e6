"""Rotary position embedding (neox / HF-Llama style: rotate the two halves).

Supported scalings: "default", "linear" and Llama-3's "llama3" (frequency-band
dependent slow-down, see `_llama3_inv_freq`). The cos/sin table is built once in
fp32 for positions [0, max_position) and shared by all layers of a model.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from conveyor.kernels import cpu_attention


def rope_params_from_config(hf_config: Any) -> tuple[float, dict[str, Any] | None, int]:
    """(rope_theta, scaling dict or None, rotary_dim) from an HF config.

    transformers >= 5 keeps everything in `config.rope_parameters` (with
    "rope_theta" inside); older versions use `rope_theta` + `rope_scaling`.
    """
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor",
                               getattr(hf_config, "partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
    if scaling is not None and rope_type == "llama3":
        # HF falls back to max_position_embeddings when the original length is absent.
        scaling.setdefault("original_max_position_embeddings",
                           hf_config.max_position_embeddings)
    return base, scaling, int(head_dim * partial)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original_ctx/low_freq_factor are
    slowed down by `factor`, shorter than original_ctx/high_freq_factor kept,
    and the band in between interpolated smoothly."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, base: float,
                     scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, rd], cos/sin [T, 1, rd/2]: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer (moves with the module)

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(rotary_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, rotary_dim]: cos half then sin half, fp32.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), -1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, Hq*D], key [T, Hkv*D] -> rotated, same shapes.
        With the CPU kernels loaded, fp32 and bf16 rows are rotated in place by
        one native pass: fp32 with the torch form's roundings, bf16 computed in
        fp32 and rounded once (the torch form rounds after every op)."""
        ext = cpu_attention.loaded()
        if ext is not None and self._native_ok(positions, query, key):
            ext.rotary_neox(positions, query, key, self.cos_sin_cache, self.head_size)
            return query, key
        cos, sin = self._cos_sin(positions, query.dtype)
        return self._rotate_heads(query, cos, sin), self._rotate_heads(key, cos, sin)

    def _native_ok(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
        return (query.device.type == "cpu" and query.dtype == key.dtype
                and query.dtype in (torch.float32, torch.bfloat16)
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and query.dim() == key.dim() == 2 and query.stride(1) == key.stride(1) == 1
                and self.cos_sin_cache.dtype == torch.float32)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: look up once.
        last = self.__dict__.get("_last")
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        self.__dict__["_last"] = (positions, dtype, cos, sin)
        return cos, sin

    # Not `_apply`: that name is nn.Module's hook for .to()/.float(), which it would break.
    def _rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rd = self.rotary_dim
        if rd == self.head_size:
            return _rotate(x, cos, sin).view(shape)
        rot = _rotate(x[..., :rd], cos, sin)
        return torch.cat((rot, x[..., rd:]), dim=-1).view(shape)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             scaling: dict[str, Any] | None = None) -> RotaryEmbedding:
    """A shared RotaryEmbedding per (shape, scaling, default device): every layer
    of a model uses one cos/sin table instead of one each."""
    frozen = tuple(sorted((k, str(v)) for k, v in (scaling or {}).items()))
    key = (head_size, rotary_dim, max_position, base, frozen, str(torch.get_default_device()))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_size, rotary_dim, max_position, base, scaling)
    return _ROPE_CACHE[key]


def get_rope_from_config(hf_config: Any, head_size: int) -> RotaryEmbedding:
    base, scaling, rotary_dim = rope_params_from_config(hf_config)
    return get_rope(head_size, rotary_dim, hf_config.max_position_embeddings, base, scaling)
