"""The host tier's copies on a CUDA side stream, so the forward waits only
for what it must.

Per step, in start_load_kv's order:
- save(): the side stream first waits for the compute stream (the blocks'
  last writes), then gathers the blocks device to device into a staging
  buffer: the forward, which may overwrite those blocks, waits for this only;
- load(): a pinned host row the worker has checked is copied into its pool
  block, on the side stream;
- before_forward(): the compute stream waits for the gathers and loads, then
  the side stream copies the staged blocks to their pinned host rows without
  the forward waiting for them;
- finish_saves() (the next step's start): waits for those copies; only then
  are the rows summed and named, so no load or demote reads a row in flight.

Stream order on the one side stream keeps a slot's copies in issue order (a
load reading a slot runs before a later save overwrites it). A load of a
slot saved in the same step finds it unnamed and is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.kv_connector.metadata import BlockSave
from conveyor.workers.kv_connector.block_io import BlockCodec


@dataclass
class _Staged:
    staging: torch.Tensor  # [n, bytes_per_block] uint8 on the device (side stream's memory)
    host: torch.Tensor  # the pinned host tier
    saves: list[BlockSave]
    done: torch.cuda.Event | None = None


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._staged: list[_Staged] = []  # gathered, D2H not issued yet
        self._copying: list[_Staged] = []  # D2H issued

    def _follow_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def save(self, codec: BlockCodec, block_ids: list[int], host: torch.Tensor,
             saves: list[BlockSave]) -> None:
        self._follow_compute()
        with torch.cuda.stream(self.stream):
            staging = torch.empty((len(block_ids), codec.bytes_per_block), dtype=torch.uint8,
                                  device=self.device)
            codec.gather(block_ids, staging)
        self._staged.append(_Staged(staging, host, saves))

    def load(self, codec: BlockCodec, row: torch.Tensor, block_id: int) -> None:
        self._follow_compute()
        with torch.cuda.stream(self.stream):
            codec.scatter(row, [block_id], non_blocking=True)

    def before_forward(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        with torch.cuda.stream(self.stream):
            for st in self._staged:
                for i, s in enumerate(st.saves):
                    st.host[s.slot].copy_(st.staging[i], non_blocking=True)
                st.done = torch.cuda.Event()
                st.done.record(self.stream)
        self._copying += self._staged
        self._staged = []

    def finish_saves(self) -> list[BlockSave]:
        """The saves whose host rows are written now (all issued ones)."""
        if self._staged:  # a step that never reached its forward
            self.before_forward()
        out: list[BlockSave] = []
        for st in self._copying:
            assert st.done is not None  # set when the copy was issued
            st.done.synchronize()
            out += st.saves
        self._copying = []
        return out
