"""Tensor-parallel layers.

Every Parameter carries `weight_loader(param, loaded_weight, shard_id=None)`:
it copies into `param` only this rank's part of a checkpoint tensor.
`loaded_weight` is a torch.Tensor or a safetensors slice
(`safe_open(...).get_slice(name)`); slices are narrowed *before* being
materialised, so a rank reads only the bytes it keeps.

The rank and size are read from `conveyor.parallel.state` when a layer is built and kept
on the layer, so weight loading needs no process group (tests fake them).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu_linear, huge_pages
from conveyor.parallel import state
from conveyor.parallel.state import divide

WeightLike = Any  # torch.Tensor | safetensors PySafeSlice
WeightLoader = Callable[..., None]


# ---------------------------------------------------------------- loading ----

def weight_shape(w: WeightLike) -> list[int]:
    return list(w.shape) if isinstance(w, torch.Tensor) else list(w.get_shape())


def materialize(w: WeightLike) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[...]


def narrow_load(w: WeightLike, dim: int, start: int, size: int) -> torch.Tensor:
    """`w.narrow(dim, start, size)` for a tensor or a safetensors slice."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, size)
    index = [slice(None)] * len(w.get_shape())
    index[dim] = slice(start, start + size)
    return w[tuple(index)]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not "
                         f"match parameter shape {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: WeightLike,
                          shard_id: Any = None) -> None:
    """Replicated parameter: every rank keeps the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got shard_id {shard_id!r}")
    _copy_checked(param.data, materialize(loaded_weight), "replicated weight")


def host_empty(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """torch.empty on the ambient default device; a large CPU tensor goes on
    huge pages (conveyor/kernels/huge_pages.py: decode streams the weights)."""
    if torch.get_default_device().type == "cpu":
        return huge_pages.empty(shape, dtype or torch.get_default_dtype())
    return torch.empty(shape, dtype=dtype)


def make_param(shape: tuple[int, ...], dtype: torch.dtype | None,
               loader: WeightLoader) -> nn.Parameter:
    # Inference only: no grads. Allocated on the ambient default device
    # (the loader builds models under `with torch.device(device)`).
    p = nn.Parameter(host_empty(shape, dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


# ----------------------------------------------------------------- linear ----

class _LinearBase(nn.Module):
    """Holds tp rank/size captured at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_rank = state.tp_rank()
        self.tp_size = state.tp_size()



_ONEDNN = torch.backends.mkldnn.is_available()
# Dtypes whose linears run oneDNN with a packed weight: fp32 always, bf16 where
# oneDNN has native bf16 kernels (AVX512_BF16 / AMX: bf16 math, fp32 accumulation).
_PACKED_DTYPES = (torch.float32,) + (
    (torch.bfloat16,) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())
# On AMX, above this many rows a bf16 linear goes to F.linear (oneDNN's own
# matmul, weight reordered per call): at M = 2048 it ran 1.2-1.9x the packed
# primitive, which wins below (1.1-1.4x at M <= 256; BENCHMARKS "bf16"). With
# AVX512_BF16 and no AMX the packed primitive wins or ties at every M (30M
# shapes 1.1-1.2x at M = 512-2048; BENCHMARKS "Zen 5"), so every row count packs.
_BF16_PACKED_ROWS = 256 if cpu_linear.amx() else 1 << 62


def onednn_rows(m: int) -> int:
    """The row count oneDNN sees for m input rows. oneDNN keeps ~0.8 MiB per
    distinct row count above 64 (its primitives, never freed): unbucketed, an
    engine's RSS grew by ~1 GiB as step token counts varied. Up to 64 rows
    (decode) stay exact; above, rows pad up to a multiple of 16 (<= 256) or 64,
    at most ~25% extra rows and a bounded number of shapes."""
    if m <= 64:
        return m
    step = 16 if m <= 256 else 64
    return -(-m // step) * step


def _packed_copy(module: nn.Module, slot: str, w: torch.Tensor,
                 pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``pack(w)``, kept in ``module.__dict__[slot]`` and keyed by the weight's
    storage and version, so a reload (in place or a new tensor) repacks."""
    cached = module.__dict__.get(slot)
    key = (w.data_ptr(), w._version)
    if cached is None or cached[0] != key:
        cached = (key, pack(w))
        module.__dict__[slot] = cached
    return cached[1]


def small_packed(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The packed kernel's copy of the layer's weight w (made at its first
    use, remade when w is reloaded)."""
    return _packed_copy(module, "_small_packed", w, cpu_linear.pack)


def _kernel_isa(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """The small-M kernels' table for this call (fp32/bf16 x and w alike, 2-D,
    on CPU with the extension loaded), else None."""
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in cpu_linear.DTYPES or w.dtype != x.dtype:
        return None
    return cpu_linear.kernel_isa()


def mark_decode_rows(model: nn.Module, rows: int) -> None:
    """Tell every module of ``model`` its engine's largest decode step (rows):
    where that fits the plain kernel, no layer packs a copy of its weights
    (cpu_linear.packs)."""
    for m in model.modules():
        m.__dict__["_decode_rows"] = rows


def decode_rows_of(module: nn.Module) -> int | None:
    """The rows mark_decode_rows gave ``module`` (None: not marked)."""
    return module.__dict__.get("_decode_rows")


def _small_isa(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> str | None:
    """The packed kernel's table where this call's rows are its (at most
    cpu_linear.small_rows), else None."""
    isa = _kernel_isa(x, w)
    if isa is None or x.shape[0] > cpu_linear.small_rows(isa, x.dtype, decode_rows_of(module)):
        return None
    return isa


def linear(module: nn.Module, x: torch.Tensor, w: torch.Tensor,
           b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CPU, where a layer keeps one copy of its weights
    unless a second one runs its rows faster (conveyor/kernels/cpu_linear.py):
    - up to cpu_linear.plain_rows rows (fp32; bf16 with vdpbf16ps): the plain
      kernel on w itself;
    - then up to cpu_linear.small_rows rows (fp32, and bf16 except on AMX;
      none where the engine's decode steps fit the plain kernel): the packed
      kernel over its copy, packed at the first such call;
    - fp32 above: oneDNN over w itself (its packed copy ran no faster), or
      MKL's sgemm (F.linear) where cpu_linear.f32_on_mkl says (Intel AVX-512,
      above 256 rows where oneDNN would pad them, and from 1024 rows);
    - bf16 where oneDNN has bf16 kernels: oneDNN over its packed copy (1.3-1.6x
      w itself up to 256 rows on AMX), above _BF16_PACKED_ROWS F.linear, and
      F.linear throughout where the engine's decode steps fit the plain kernel
      (cpu_linear.packs);
    - bf16 where oneDNN has none (AVX2): fp32 oneDNN over an fp32 packed copy
      (bf16 storage, fp32 math).
    Each packed copy is keyed by the weight's version, so reloading refreshes it.
    A quantized layer (``conveyor/workers/layers/quant.py``) runs its own forward (the
    lm_head's only for decode rows: it keeps its float weight for the rest)."""
    quantized = module.__dict__.get("_quantized_forward")
    if quantized is not None:
        y = quantized(x, b)
        if y is not None:  # None: a layer that keeps its float weight runs these rows on it
            return y
    isa = _kernel_isa(x, w)
    if isa is not None and x.shape[0] <= cpu_linear.plain_rows(isa, x.dtype):
        return cpu_linear.plain_linear(x, w, b, isa)
    small = _small_isa(module, x, w)
    if small is not None:
        return cpu_linear.small_linear(x, small_packed(module, w), w.shape[0], b, small)
    if _widened_bf16(x, w):
        # bf16 storage, fp32 math: oneDNN has no bf16 kernels on this CPU, and
        # F.linear's bf16 path ran 4-5x slower than fp32 at 8-16 rows (AVX2).
        packed = _packed_copy(module, "_packed_weight_f32", w,
                              lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().float(), None))
        return _onednn(x.float(), packed, b.float() if b is not None else None).to(torch.bfloat16)
    if not _ONEDNN or x.device.type != "cpu" or x.dtype not in _PACKED_DTYPES or x.dim() != 2 \
            or w.dtype != x.dtype or (x.dtype == torch.bfloat16 and not _bf16_packs(module, x, isa)):
        return F.linear(x, w, b)
    if x.dtype == torch.float32:
        if cpu_linear.f32_on_mkl(x.shape[0], onednn_rows(x.shape[0]) > x.shape[0]):
            return F.linear(x, w, b)
        return _onednn(x, w.detach(), b)
    packed = _packed_copy(module, "_packed_weight", w,
                          lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
    return _onednn(x, packed, b)


def _bf16_packs(module: nn.Module, x: torch.Tensor, isa: str | None) -> bool:
    """Whether a bf16 call runs oneDNN over its packed copy (else F.linear on
    the weight): up to _BF16_PACKED_ROWS rows, where the layer may pack."""
    return x.shape[0] <= _BF16_PACKED_ROWS and cpu_linear.packs(isa, x.dtype, decode_rows_of(module))


def _widened_bf16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A bf16 linear on a CPU whose oneDNN has no bf16 kernels (AVX2): it runs
    fp32 oneDNN over an fp32 packed copy of the weight, the output rounded once."""
    return (_ONEDNN and torch.bfloat16 not in _PACKED_DTYPES and x.device.type == "cpu" and x.dim() == 2
            and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)


def _onednn(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear over a packed weight or a plain one (fp32: [n, K] as
    it is), rows bucketed (onednn_rows)."""
    m = x.shape[0]
    rows = onednn_rows(m)
    if rows != m:
        x = F.pad(x, (0, 0, 0, rows - m))
    y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [None], "")
    return y if rows == m else y[:m]


class ColumnParallelLinear(_LinearBase):
    """Y = X A^T with A's rows (output features) split across TP ranks.

    Output is this rank's slice of features unless `gather_output`.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = self._partition_size(output_size)
        self.gather_output = gather_output
        self.weight = make_param((self.output_size_per_partition, input_size),
                                 params_dtype, self.weight_loader)
        self.bias = (make_param((self.output_size_per_partition,), params_dtype,
                                self.weight_loader) if bias else None)

    def _partition_size(self, output_size: int) -> int:
        return divide(output_size, self.tp_size, "ColumnParallelLinear output_size / tp_size")

    def weight_loader(self, param: torch.Tensor, loaded_weight: WeightLike,
                      shard_id: Any = None) -> None:
        # weight [out, in] and bias [out] are both split on dim 0.
        size = param.shape[0]
        part = narrow_load(loaded_weight, 0, self.tp_rank * size, size)
        _copy_checked(param.data, part, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(self, x, self.weight, self.bias)
        return state.tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate_proj | up_proj).

    Per rank the weight is [shard0_rank | shard1_rank | ...]; shard i is loaded
    with shard_id=i. shard_id=None loads an already-fused checkpoint tensor.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype)

    def _partition_size(self, output_size: int) -> int:
        return sum(divide(o, self.tp_size, "MergedColumnParallelLinear output size / tp_size")
                   for o in self.output_sizes)

    def weight_loader(self, param: torch.Tensor, loaded_weight: WeightLike,
                      shard_id: int | None = None) -> None:
        shards = range(len(self.output_sizes)) if shard_id is None else [shard_id]
        for sid in shards:
            size = self.output_sizes[sid] // self.tp_size
            offset = sum(self.output_sizes[:sid]) // self.tp_size
            # In a fused checkpoint shard sid starts after the full earlier shards.
            src_base = 0 if shard_id is not None else sum(self.output_sizes[:sid])
            part = narrow_load(loaded_weight, 0, src_base + self.tp_rank * size, size)
            _copy_checked(param.data.narrow(0, offset, size), part,
                          f"{type(self).__name__} shard {sid}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with GQA.

    Query heads are split across ranks. KV heads are split when
    tp_size <= total_num_kv_heads; otherwise each rank holds one KV head and
    tp_size / total_num_kv_heads consecutive ranks share (replicate) it.
    Per rank the output is [q (num_heads*D) | k (num_kv_heads*D) | v (num_kv_heads*D)].
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        tp = state.tp_size()
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads / tp_size")
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, total_num_kv_heads,
                                               "tp_size / num_key_value_heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads / tp_size")
            self.num_kv_head_replicas = 1
        total_out = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, total_out, bias, False, params_dtype)

    def _partition_size(self, output_size: int) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int, int]:
        """(offset in param, size, start in the unfused checkpoint tensor,
        start of this shard in a fused checkpoint tensor)."""
        d = self.head_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        total_q, total_kv = self.total_num_heads * d, self.total_num_kv_heads * d
        if shard_id == "q":
            return 0, q, self.tp_rank * q, 0
        if shard_id == "k":
            return q, kv, kv_rank * kv, total_q
        if shard_id == "v":
            return q + kv, kv, kv_rank * kv, total_q + total_kv
        raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def weight_loader(self, param: torch.Tensor, loaded_weight: WeightLike,
                      shard_id: str | None = None) -> None:
        for sid in (["q", "k", "v"] if shard_id is None else [shard_id]):
            offset, size, start, fused_base = self._shard_layout(sid)
            src_start = start + (fused_base if shard_id is None else 0)
            part = narrow_load(loaded_weight, 0, src_start, size)
            _copy_checked(param.data.narrow(0, offset, size), part,
                          f"QKVParallelLinear shard {sid}")


class RowParallelLinear(_LinearBase):
    """Y = X A^T with A's columns (input features) split across TP ranks.

    Each rank multiplies its input slice; the partial sums are all-reduced.
    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, self.tp_size,
                                               "RowParallelLinear input_size / tp_size")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.weight = make_param((output_size, self.input_size_per_partition),
                                 params_dtype, self.weight_loader)
        self.bias = (make_param((output_size,), params_dtype, default_weight_loader)
                     if bias else None)

    def weight_loader(self, param: torch.Tensor, loaded_weight: WeightLike,
                      shard_id: Any = None) -> None:
        size = self.input_size_per_partition
        part = narrow_load(loaded_weight, 1, self.tp_rank * size, size)
        _copy_checked(param.data, part, "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * size, size)
        y = linear(self, x, self.weight)
        if self.reduce_results:
            y = state.tp_all_reduce(y)  # sum of the per-rank partial products
        if self.bias is not None:
            y = y + self.bias
        return y


# -------------------------------------------------------------- embedding ----

class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in contiguous row ranges across TP ranks.

    The vocab is padded up to a multiple of tp_size; padding rows are zero.
    Rank r owns rows [r*per_rank, (r+1)*per_rank); lookups outside that range
    yield 0 on r, so the all-reduce over ranks gives every token its row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = state.tp_rank()
        self.tp_size = state.tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = make_param((self.num_embeddings_per_partition, embedding_dim),
                                 params_dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: WeightLike,
                      shard_id: Any = None) -> None:
        shape = weight_shape(loaded_weight)
        if shape[0] != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {shape[0]} rows, "
                             f"config vocab_size is {self.num_embeddings}")
        # Rows of the real vocab this rank owns; the rest of the shard is padding.
        real = max(0, min(self.vocab_end_index, self.num_embeddings) - self.vocab_start_index)
        param.data.zero_()
        if real > 0:
            part = narrow_load(loaded_weight, 0, self.vocab_start_index, real)
            _copy_checked(param.data.narrow(0, 0, real), part, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return state.tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing VocabParallelEmbedding's layout.

    Tied embeddings: the model assigns `lm_head.weight = embed_tokens.weight`.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise RuntimeError("ParallelLMHead is not an embedding; call get_logits()")

    def get_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, num_embeddings] logits, gathered on every TP rank."""
        logits = linear(self, hidden_states, self.weight)
        logits = state.tp_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]
