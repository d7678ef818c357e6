"""Decode steps of a few rows through a Llama-family decoder without the
module tree's Python around each native call.

At batch 1 the 30M Llama's step took 6.2 ms on the Xeon: 3.3 ms in its linears,
0.45 ms in attention, most of the rest in the Python around ~60 native calls
(module calls, ``linear``'s routing checks per call, the attention wrapper).
``DecodeStack`` decides once per model what each call is (``decode_linear``
binds every projection's kernel) and runs a decode-only step of as many rows
as the small-M kernels take as one flat loop of those calls; where every
projection runs the plain kernel (fp32 4 rows, bf16 2) or the int8 one (16
rows), the whole loop is one native call (``csrc/decode_layers.cpp``). Either
way the ops are the modules', in their order, so the output is the modules'
bit for bit (tests/cpu/integration/test_decode_stack.py). 30M batch 1: 6.2 ->
3.0 ms a token. A model or a step outside what it covers runs through the
modules. ``CONVEYOR_DECODE_STACK=0`` turns it off.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_attention, cpu_linear
from conveyor.parallel import state
from conveyor.parallel.decode_linear import decode_linear, decode_rows
from conveyor.parallel.layers import VocabParallelEmbedding, decode_rows_of
from conveyor.workers.layers.activation import SiluAndMul
from conveyor.workers.layers.attention import Attention
from conveyor.workers.layers.layernorm import RMSNorm
from conveyor.workers.layers.quant import INT8_KERNEL_ROWS
from conveyor.workers.layers.rotary import RotaryEmbedding

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as the loop reads it: its norm weights (Parameters,
    which a reload copies into), its attention module (whose KV cache is read
    each step), the shapes, and its four bound projections."""

    norms: tuple[torch.Tensor, float, torch.Tensor, float]  # input, post-attention: weight, eps
    split: list[int]  # q, k, v widths of the qkv output
    cos_sin: torch.Tensor
    rotary_head: int
    attn: Attention
    heads: tuple[int, int, int]  # query heads, kv heads, head size
    scale: float
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    @staticmethod
    def of(layer: Any, qkv: Linear, o: Linear, gate_up: Linear, down: Linear) -> _Layer:
        a, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
        at = a.attn
        return _Layer((n1.weight, n1.eps, n2.weight, n2.eps), [a.q_size, a.kv_size, a.kv_size],
                      a.rotary_emb.cos_sin_cache, a.rotary_emb.head_size, at,
                      (at.num_heads, at.num_kv_heads, at.head_size), float(at.scale), qkv, o, gate_up, down)


@dataclass(frozen=True)
class _Ends:
    """What a step runs around the layers: the embedding table and the final
    norm (Parameters, which a reload copies into)."""

    embed: torch.Tensor
    norm: torch.Tensor
    eps: float


@dataclass(frozen=True)
class _Native:
    """The loop in one native call (``csrc/decode_layers.cpp``) for the rows
    where every projection runs the plain kernel (fp32, bf16) or the int8 one:
    each layer's tensors but its KV cache (read per step), and what every layer
    shares."""

    rows: int  # the plain kernel's, or the int8 kernel's
    tensors: list[list[torch.Tensor]]
    dims: list[int]  # query heads, kv heads, head size, rotary head size
    consts: list[float]  # input norm eps, post-attention norm eps, attention scale
    isa: str

    @staticmethod
    def of(layers: list[Any], bound: list[_Layer], isa: str, dtype: torch.dtype) -> _Native | None:
        projs = [(x.self_attn.qkv_proj, x.self_attn.o_proj, x._mlp.gate_up_proj, x._mlp.down_proj) for x in layers]
        quantized = {"_quantized_forward" in m.__dict__ for p in projs for m in p}
        shared = {(c.norms[1], c.norms[3], c.scale, c.heads, c.rotary_head) for c in bound}
        if len(quantized) != 1 or len(shared) != 1:
            return None
        empty = torch.empty(0, dtype=dtype)

        def triple(m: Any) -> list[torch.Tensor]:
            """decode_layers.cpp's three tensors of a projection."""
            bias = m.bias if m.bias is not None else empty
            q = m.__dict__.get("_quantized_forward")
            return [q.keywords["packed"], q.keywords["scale"], bias] if q is not None else [m.weight, empty, bias]

        tensors = [[c.norms[0], *triple(q), *triple(o), *triple(gu), *triple(dn), c.norms[2], c.cos_sin]
                   for c, (q, o, gu, dn) in zip(bound, projs)]
        rows = INT8_KERNEL_ROWS if True in quantized else cpu_linear.plain_rows(isa, dtype)
        c = bound[0]
        return _Native(rows, tensors, [*c.heads, c.rotary_head], [c.norms[1], c.norms[3], c.scale], isa)


class DecodeStack:
    """A model's decoder layers bound for decode steps of at most ``max_rows``
    rows: the small-M kernels' (fp32 64; bf16 16, 2 on AMX; only the plain
    kernel's 4 / 2 where the engine's decode steps fit it)."""

    def __init__(self, layers: list[_Layer], ends: _Ends, max_rows: int, ext: Any,
                 native: _Native | None) -> None:
        self.layers = layers
        self.ends = ends
        self.max_rows = max_rows
        self._ext = ext
        self._native = native

    @staticmethod
    def build(layers: list[Any], embed: Any, norm: Any) -> DecodeStack | None:
        """The stack for these decoder layers, or None where one of them (or
        the setup) is not what it runs: one TP rank, the cpu backend's kernels,
        fp32/bf16, the neox rotary, SiLU, RMSNorm, no LoRA wrapper, a KV cache
        of the model's dtype. The caller builds it once every layer has its KV
        cache, and vouches that each layer is the plain Llama layer (llama.py,
        ``plain_layer``: its q/k/v with no q/k norm, a dense MLP). ``embed`` and
        ``norm`` are the model's embedding and final norm, which each step runs
        around the layers."""
        ext, isa = cpu_attention.loaded(), cpu_linear.kernel_isa()
        if os.environ.get("CONVEYOR_DECODE_STACK", "1") == "0" or ext is None or isa is None \
                or state.tp_size() != 1 or not layers:
            return None
        dtype: torch.dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in cpu_linear.DTYPES or type(embed) is not VocabParallelEmbedding \
                or type(norm) is not RMSNorm or embed.weight.dtype != dtype or norm.weight.dtype != dtype:
            return None
        rows = decode_rows(dtype, decode_rows_of(layers[0].self_attn.qkv_proj))
        out: list[_Layer] = []
        for layer in layers:
            a, mlp = layer.self_attn, layer._mlp
            cache: Any = a.attn.kv_cache  # set: the caller builds once every layer has one
            if not (type(mlp.act_fn) is SiluAndMul
                    and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                    and type(a.rotary_emb) is RotaryEmbedding and a.rotary_emb.cos_sin_cache.dtype == torch.float32
                    and type(a.attn) is Attention
                    and cache.dtype == dtype and cache.is_contiguous()):
                return None
            calls = [decode_linear(m, dtype, rows) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(c is None for c in calls):
                return None
            qkv, o, gate_up, down = calls
            assert qkv is not None and o is not None and gate_up is not None and down is not None
            out.append(_Layer.of(layer, qkv, o, gate_up, down))
        ends = _Ends(embed.weight, norm.weight, norm.eps)
        return DecodeStack(out, ends, rows, ext, _Native.of(layers, out, isa, dtype))

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
        ext, meta = self._ext, ctx.attn_metadata
        plan = meta.__dict__.get("_cpu_plan")
        if plan is None:  # shared with the module path's layers, as CpuAttentionBackend.forward does
            plan = meta.__dict__["_cpu_plan"] = cpu_attention.step_plan(meta)
        rows, slots = input_ids.shape[0], meta.slot_mapping
        nat = self._native
        if nat is not None and rows <= nat.rows:
            layers: list[list[Any]] = [[*t, c.attn.kv_cache] for t, c in zip(nat.tensors, self.layers)]
            out: torch.Tensor = ext.decode_layers(
                input_ids, self.ends.embed, [positions, slots, plan.table, *plan.short], layers,
                self.ends.norm, [*nat.dims, plan.part_len], [*nat.consts, self.ends.eps], nat.isa)
            return out
        hidden, residual = F.embedding(input_ids, self.ends.embed), None
        rms, rotary, write_kv, attend, silu = (ext.rms_norm, ext.rotary_neox, ext.write_kv,
                                               ext.paged_attention_short, ext.silu_and_mul)
        table, short, part_len = plan.table, plan.short, plan.part_len
        for c in self.layers:
            w1, eps1, w2, eps2 = c.norms
            hq, hkv, d = c.heads
            h, residual = rms(hidden, residual, w1, eps1)
            q, k, v = c.qkv(h).split(c.split, dim=-1)
            rotary(positions, q, k, c.cos_sin, c.rotary_head)
            cache = c.attn.kv_cache
            write_kv(k.view(rows, hkv, d), v.view(rows, hkv, d), cache, slots)
            q3 = q.view(rows, hq, d).contiguous()
            o = torch.empty(q3.shape, dtype=q3.dtype)
            attend(q3, cache, table, *short, c.scale, o, part_len)
            h, residual = rms(c.o(o.view(rows, -1)), residual, w2, eps2)
            hidden = c.down(silu(c.gate_up(h)))
        out, _ = rms(hidden, residual, self.ends.norm, self.ends.eps)
        return out
