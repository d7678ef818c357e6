"""Worker-side request state: CachedRequestState, the persistent InputBatch
(numpy token table, computed counts) and the BlockTable.

Rows 0..num_reqs-1 are dense after condense(); a row's order has no meaning
beyond matching the flattened token order of the step.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.engine.lora import LoRARequest
from conveyor.engine.multimodal.features import MultiModalFeature
from conveyor.engine.sampling_params import SamplingFields


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingFields
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"request needs {end} blocks, the table holds {self.table.shape[1]}")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n

    def slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        block_numbers = self.table[req_indices, positions // block_size].astype(np.int64)
        return block_numbers * block_size + positions % block_size


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size))
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        # The lowest free row, whatever order rows were freed in: every TP rank
        # must put the same request in the same row (finished ids arrive as a
        # set, whose order differs between processes).
        if self._holes:
            row = heapq.heappop(self._holes)
            self.req_ids[row] = state.req_id
        else:
            row = len(self.req_ids)
            if row >= self.max_num_reqs:
                raise ValueError(f"more than max_num_seqs={self.max_num_reqs} requests in a batch")
            self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        n_prompt = len(state.prompt_token_ids)
        n = n_prompt + len(state.output_token_ids)
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            heapq.heappush(self._holes, row)
        return row

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1

    def set_draft_tokens(self, row: int, drafts: list[int]) -> None:
        """Write a step's drafts after the row's known tokens (num_tokens does
        not move: accepted drafts are appended like sampled tokens)."""
        n = self.num_tokens[row]
        self.token_ids[row, n:n + len(drafts)] = drafts

    def condense(self) -> None:
        """Fill holes with rows from the end so rows 0..num_reqs-1 are live."""
        if not self._holes:
            return
        holes = sorted(self._holes)
        self._holes = []
        ids = self.req_ids
        hi = len(ids) - 1
        for dst in holes:
            while hi >= 0 and ids[hi] is None:
                hi -= 1
            if hi <= dst:
                break
            self._move(hi, dst)
            hi -= 1
        del ids[self.num_reqs:]

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        assert rid is not None  # condense moves live rows only
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.num_tokens[dst] = n
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.block_table.move_row(src, dst)
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.req_id_to_index[rid] = dst


@dataclass
class PreparedInputs:
    """Flattened inputs of one step, as numpy (host) arrays."""
    req_indices: np.ndarray
    query_pos: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray


def prepare_inputs(batch: InputBatch, num_scheduled: np.ndarray, block_size: int) -> PreparedInputs:
    """num_scheduled[i] tokens for row i (rows 0..num_reqs-1, dense)."""
    num_reqs = len(num_scheduled)
    if int(num_scheduled.sum()) == num_reqs:  # every row >= 1, so a decode step: one token each
        return _prepare_decode(batch, num_reqs, block_size)
    req_indices = np.repeat(np.arange(num_reqs, dtype=np.int32), num_scheduled)
    cu = np.cumsum(num_scheduled, dtype=np.int32)
    query_pos = np.arange(cu[-1], dtype=np.int32) - np.repeat(cu - num_scheduled, num_scheduled)
    positions = batch.num_computed_tokens[req_indices] + query_pos
    input_ids = batch.token_ids[req_indices, positions]
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu
    seq_lens = batch.num_computed_tokens[:num_reqs] + num_scheduled.astype(np.int32)
    slot_mapping = batch.block_table.slot_mapping(req_indices, positions, block_size)
    return PreparedInputs(req_indices, query_pos, positions, input_ids, query_start_loc,
                          seq_lens, slot_mapping, query_start_loc[1:] - 1)


def _prepare_decode(batch: InputBatch, num_reqs: int, block_size: int) -> PreparedInputs:
    """prepare_inputs for one token per row, with fewer array ops: at batch 1
    the general path's repeat/cumsum work was a tenth of the step's Python."""
    rows = np.arange(num_reqs, dtype=np.int32)
    positions = batch.num_computed_tokens[:num_reqs].copy()
    query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
    return PreparedInputs(rows, np.zeros(num_reqs, dtype=np.int32), positions,
                          batch.token_ids[rows, positions], query_start_loc, positions + 1,
                          batch.block_table.slot_mapping(rows, positions, block_size), rows)
