"""CUDA graphs for decode-only steps (vLLM's piecewise-free "full" decode graphs).

A decode step's shapes depend only on its batch size, so the forward is
captured once per size in `capture_sizes` (1, 2, 4, 8, then 16 upward in
steps of 16 up to max_num_seqs) and a batch of n rows replays the smallest
captured size >= n, padded. A graph replays fixed device addresses with the
host values it saw at capture, so:

- every input lives in persistent buffers (`DecodeGraphRunner`), copied in
  before each replay; the metadata's host values are the capture's (max_query_len
  1, max_seq_len max_model_len: the Triton kernel sizes its grid from them only);
- padding rows write no KV (slot -1, which every backend skips), read the null
  block 0 through a one-token context and have their outputs dropped;
- backends or features that read per-step host values or change the step's
  shape are refused (`graphs_refused`): the torch and cpu attention backends
  (they loop over host copies of seq_lens), speculative drafts (several query
  tokens per row), pipeline parallelism (IntermediateTensors cross stages).

The capture itself is behind `Capturer`: `CudaGraphCapturer` on a GPU, and on
CPU the tests' recorder, which records the forward's aten calls and replays the
same calls on the same buffers (tests/cpu/unit/test_cuda_graphs.py).
"""
from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from conveyor.engine.config import EngineConfig
from conveyor.kernels.backends import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

Forward = Callable[[AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then 16, 32, ... up to max_num_seqs (vLLM's default list)."""
    return [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None: run eager."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graphs_refused(config: EngineConfig, device: torch.device, backend_name: str) -> str | None:
    """Why decode graphs cannot be used here, or None when they can."""
    if config.model.enforce_eager:
        return "model.enforce_eager is set"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if backend_name != "triton":
        return f"attention backend {backend_name!r} reads per-step host values (graphs need 'triton')"
    if config.speculative.enabled:
        return "speculative decoding verifies several query tokens per row"
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism passes IntermediateTensors between stages"
    return None


class Capturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record fn (reading and writing only persistent tensors); return a
        replay that redoes its work on the buffers' current contents."""
        ...


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph with one memory pool shared by every size
    (captured largest first, so the smaller graphs reuse its memory)."""

    def __init__(self) -> None:
        self.pool: _POOL_HANDLE | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits and autotuning stay outside the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class DecodeGraphRunner:
    """Persistent inputs and one captured forward per size."""

    def __init__(self, forward: Forward, sizes: list[int], max_blocks: int, max_model_len: int,
                 device: torch.device, capturer: Capturer) -> None:
        self.forward, self.sizes, self.capturer = forward, sizes, capturer
        self.max_model_len = max_model_len
        m = sizes[-1]
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=device)
        # One token per row, never rewritten.
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(m, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_table[:size],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int32),
            seq_lens_cpu=np.full(size, self.max_model_len, dtype=np.int32))

    def capture_all(self) -> None:
        """Largest first (a shared pool serves the smaller ones), on padding
        inputs: every row a one-token context in the null block, no KV write."""
        self._pad(0, self.sizes[-1])
        for size in reversed(self.sizes):
            meta = self._meta(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            # Bound now: capture() may replay the callable after this iteration.
            self.graphs[size] = self.capturer.capture(functools.partial(self.forward, meta, ids, pos))

    def _pad(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        self.input_ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slot_mapping[lo:hi] = -1
        self.seq_lens[lo:hi] = 1
        self.block_table[lo:hi] = 0

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_table: np.ndarray) -> torch.Tensor | None:
        """A decode-only step of n = len(seq_lens) rows (one token each):
        the hidden states [n, ...], or None when n is past the largest size."""
        n = len(seq_lens)
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        nb = block_table.shape[1]
        self.input_ids[:n].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.block_table[:n, :nb].copy_(torch.from_numpy(block_table), non_blocking=True)
        self.block_table[:n, nb:] = 0  # a shorter table than a previous step's: no stale ids
        self._pad(n, size)
        return self.graphs[size]()[:n]
