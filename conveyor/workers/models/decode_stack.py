"""Decode steps of a Llama-family decoder in one native call, without the
module tree's Python around each kernel.

At batch 1 the 30M Llama's step took 6.2 ms on the Xeon: 3.3 ms in its linears,
0.45 ms in attention, most of the rest in the Python around ~60 native calls
(module calls, ``linear``'s routing checks per call, the attention wrapper).
``DecodeStack`` checks once per model that every layer is one it runs
(``decode_linear.routable``) and runs each decode-only step of up to the
small-M kernels' rows (fp32 64; bf16 16, 2 on AMX) as one call into
``csrc/decode_layers.cpp``: embedding, the layers, the final norm. The ops are
the modules', in their order and routed as ``linear`` routes them, so the
output is the modules' bit for bit (tests/cpu/integration/test_decode_stack.py).
30M batch 1: 6.2 -> 3.0 ms a token. A model or a step outside what it covers
runs through the modules. ``CONVEYOR_DECODE_STACK=0`` turns it off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.kernels import cpu_attention, cpu_linear
from conveyor.parallel import state
from conveyor.parallel.decode_linear import decode_rows, routable
from conveyor.parallel.layers import VocabParallelEmbedding, decode_rows_of, small_packed
from conveyor.workers.layers.activation import SiluAndMul
from conveyor.workers.layers.attention import Attention
from conveyor.workers.layers.layernorm import RMSNorm
from conveyor.workers.layers.quant import INT8_KERNEL_ROWS
from conveyor.workers.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as a step reads it: its attention module (whose KV
    cache is read each step) and its four projections (whose packed copies are
    looked up each step, so a reload is seen)."""

    attn: Attention
    projections: list[Any]  # qkv, o, gate_up, down


@dataclass(frozen=True)
class _Native:
    """What decode_layers.cpp takes besides the step: each layer's tensors but
    its KV cache and packed copies (read per step), and what every layer
    shares (each layer's norms, rotary and attention constants are checked to
    be the first one's)."""

    tensors: list[list[torch.Tensor]]
    dims: list[int]  # query heads, kv heads, head size, rotary head size
    consts: list[float]  # input norm eps, post-attention norm eps, attention scale
    embed: torch.Tensor  # the embedding table and the final norm (Parameters: a reload copies into them)
    norm: torch.Tensor
    norm_eps: float
    isa: str
    dtype: torch.dtype
    unpacked: int  # up to this many rows no projection reads a packed copy (the plain or int8 kernels')
    none: list[torch.Tensor]  # four empty tensors: a layer's packed copies on those rows

    @staticmethod
    def of(layers: list[Any], embed: Any, norm: Any, isa: str, dtype: torch.dtype) -> _Native | None:
        """None where the layers differ in what the call shares, or mix
        quantized and float projections."""
        def shared(x: Any) -> tuple[Any, ...]:
            a, at = x.self_attn, x.self_attn.attn
            return (x.input_layernorm.eps, x.post_attention_layernorm.eps, float(at.scale), at.num_heads,
                    at.num_kv_heads, at.head_size, a.rotary_emb.head_size, a.q_size, a.kv_size)
        projs = [_projections(x) for x in layers]
        quantized = {"_quantized_forward" in m.__dict__ for p in projs for m in p}
        if len(quantized) != 1 or len({shared(x) for x in layers}) != 1:
            return None
        empty = torch.empty(0, dtype=dtype)

        def triple(m: Any) -> list[torch.Tensor]:
            """decode_layers.cpp's three tensors of a projection."""
            bias = m.bias if m.bias is not None else empty
            q = m.__dict__.get("_quantized_forward")
            return [q.keywords["packed"], q.keywords["scale"], bias] if q is not None else [m.weight, empty, bias]

        tensors = [[x.input_layernorm.weight, *(t for m in p for t in triple(m)), x.post_attention_layernorm.weight,
                    x.self_attn.rotary_emb.cos_sin_cache] for x, p in zip(layers, projs)]
        eps1, eps2, scale, hq, hkv, d, rot = shared(layers[0])[:7]
        unpacked = 1 << 62 if True in quantized else cpu_linear.plain_rows(isa, dtype)
        return _Native(tensors, [hq, hkv, d, rot], [eps1, eps2, scale], embed.weight, norm.weight, norm.eps,
                       isa, dtype, unpacked, [empty] * 4)


def _projections(layer: Any) -> list[Any]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer._mlp.gate_up_proj, layer._mlp.down_proj]


class DecodeStack:
    """A model's decoder layers bound for decode steps of at most ``max_rows``
    rows: the small-M kernels' (fp32 64; bf16 16, 2 on AMX; only the plain
    kernel's 4 / 2 where the engine's decode steps fit it)."""

    def __init__(self, layers: list[_Layer], native: _Native, max_rows: int, ext: Any) -> None:
        self.layers = layers
        self.native = native
        self.max_rows = max_rows
        self._ext = ext

    @staticmethod
    def build(layers: list[Any], embed: Any, norm: Any) -> DecodeStack | None:
        """The stack for these decoder layers, or None where one of them (or
        the setup) is not what it runs: one TP rank, the cpu backend's kernels,
        fp32/bf16 (int8 weights on fp32), the neox rotary, SiLU, RMSNorm, no
        LoRA wrapper, a KV cache of the model's dtype. The caller builds it
        once every layer has its KV cache, and vouches that each layer is the
        plain Llama layer (llama.py, ``plain_layer``: its q/k/v with no q/k
        norm, a dense MLP). ``embed`` and ``norm`` are the model's embedding
        and final norm, which each step runs around the layers."""
        ext, isa = cpu_attention.loaded(), cpu_linear.kernel_isa()
        if os.environ.get("CONVEYOR_DECODE_STACK", "1") == "0" or ext is None or isa is None \
                or state.tp_size() != 1 or not layers:
            return None
        dtype: torch.dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in cpu_linear.DTYPES or type(embed) is not VocabParallelEmbedding \
                or type(norm) is not RMSNorm or embed.weight.dtype != dtype or norm.weight.dtype != dtype:
            return None
        rows = decode_rows(dtype, decode_rows_of(layers[0].self_attn.qkv_proj))
        if rows == 0:
            return None
        for layer in layers:
            a, mlp = layer.self_attn, layer._mlp
            cache: Any = a.attn.kv_cache  # set: the caller builds once every layer has one
            if not (type(mlp.act_fn) is SiluAndMul
                    and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                    and type(a.rotary_emb) is RotaryEmbedding and a.rotary_emb.cos_sin_cache.dtype == torch.float32
                    and type(a.attn) is Attention
                    and cache.dtype == dtype and cache.is_contiguous()
                    and all(routable(m, dtype, rows) for m in _projections(layer))):
                return None
        native = _Native.of(layers, embed, norm, isa, dtype)
        if native is None:
            return None
        return DecodeStack([_Layer(x.self_attn.attn, _projections(x)) for x in layers], native, rows, ext)

    def covers(self, rows: int, ctx: Any) -> bool:
        """Whether this step is one it runs: decode rows only (one query token
        each, no padding), at most max_rows, on the cpu backend, no layerwise
        KV connector."""
        if ctx is None or ctx.attn_metadata is None or ctx.kv_connector is not None \
                or not isinstance(ctx.attn_backend, cpu_attention.CpuAttentionBackend):
            return False
        meta = ctx.attn_metadata
        return rows <= self.max_rows and meta.max_query_len == 1 and meta.num_actual_tokens == rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Embedding, the layers and the final norm over the rows' tokens: the
        model's final hidden states, as its modules return them."""
        meta, nat = ctx.attn_metadata, self.native
        plan = cpu_attention.step_plan(meta)
        rows = input_ids.shape[0]
        if rows <= nat.unpacked:
            layers: list[list[Any]] = [[*t, c.attn.kv_cache, *nat.none] for t, c in zip(nat.tensors, self.layers)]
        else:
            layers = [[*t, c.attn.kv_cache, *(small_packed(m, m.weight) for m in c.projections)]
                      for t, c in zip(nat.tensors, self.layers)]
        out: torch.Tensor = self._ext.decode_layers(
            input_ids, nat.embed, [positions, meta.slot_mapping, plan.table, *plan.short], layers, nat.norm,
            [*nat.dims, plan.part_len, INT8_KERNEL_ROWS], [*nat.consts, nat.norm_eps], nat.isa)
        return out
