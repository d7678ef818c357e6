"""What every attention backend meets: the per-step metadata of a varlen
batch and the backend protocol (the registry is conveyor/kernels/backends.py).

KV cache layout shared by every backend: one tensor per layer,
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 = K, 1 = V).
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. Block 0 is
the reserved null block; it never holds data that attention reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


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
