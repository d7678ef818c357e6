"""Attention backend protocol, per-step metadata and the backend registry.

KV cache layout shared by every backend: one tensor per layer,
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. Block 0 is
the reserved null block; it never holds data that attention reads.

Nothing here imports Triton: the Triton backend module is imported only when
``get_attention_backend`` selects it, so that ``TRITON_INTERPRET`` (needed on
CPU) can be set by the caller before any kernel is defined.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

logger = logging.getLogger(__name__)

BACKEND_CHOICES: tuple[str, ...] = ("torch", "cpu", "triton", "auto")


@dataclass
class AttentionMetadata:
    """Describes one forward step's varlen batch.

    Request ``r`` owns query tokens ``query_start_loc[r]:query_start_loc[r+1]``;
    its query token ``i`` sits at absolute position
    ``seq_lens[r] - query_len[r] + i`` and attends causally to KV positions
    ``0..position``, all read from the paged cache through ``block_table[r]``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; entries < 0 are padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, context incl. this step's query
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray  # same values as query_start_loc, on host
    seq_lens_cpu: np.ndarray  # same values as seq_lens, on host

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        """Tokens owned by requests; rows past this are batch padding."""
        return int(self.query_start_loc_cpu[-1])


@runtime_checkable
class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[T, Hkv, D]`` at ``slot_mapping`` (skip < 0)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``query [T, Hq, D]`` -> ``out [T, Hq, D]`` in the query's dtype.

        Rows past ``meta.num_actual_tokens`` (batch padding) come back as zeros.
        """
        ...


def _triton_usable_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cpu_or_torch() -> str:
    from . import cpu_attention

    if cpu_attention.available():
        return "cpu"
    logger.warning("falling back to the torch attention backend (slower decode): %s",
                   cpu_attention.build_error())
    return "torch"


def get_attention_backend(name: str, device: torch.device | str, cpu_isa: str = "auto") -> AttentionBackend:
    """Return the backend called ``name`` for tensors on ``device``.

    ``"auto"`` is ``"triton"`` on CUDA, and elsewhere ``"cpu"`` (the C++ kernel) when it
    builds, else ``"torch"`` with a warning. ``cpu_isa`` picks the cpu backend's
    kernel table (``cpu_attention.select_isa``; ValueError where this CPU cannot run it).
    ``"triton"`` on a non-CUDA device needs ``TRITON_INTERPRET=1`` set before
    the first kernel module import (tests only: the interpreter is slow).
    """
    device = torch.device(device)
    key = name.lower().strip()
    if key not in BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if key == "auto":
        key = "triton" if device.type == "cuda" else _cpu_or_torch()
    if key == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"the cpu attention backend runs on CPU tensors only (got {device})")
        from .cpu_attention import CpuAttentionBackend

        return CpuAttentionBackend(cpu_isa)
    if key == "torch":
        from .torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if not _triton_usable_on(device):
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device (got {device}); on CPU set "
            "TRITON_INTERPRET=1 before importing kernels, or use the 'torch' backend"
        )
    from .paged_attention import TritonAttentionBackend

    return TritonAttentionBackend()
