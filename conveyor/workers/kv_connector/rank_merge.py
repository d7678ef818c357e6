"""One KV connector report for an engine of several ranks (TP and/or PP).

Each rank moves its own shard of every block (its layers, its heads), so a
block is loaded only when every rank loaded it, and saved only when every
rank saved it. Ranks finish at different steps (a disk read lands late on
one rank): every rank gathers all ranks' reports each step and folds them
with the same RankMerge, whose state is therefore identical everywhere.

Rules (over the reports since a load or save began):
- a load is finished once every rank reported it finished; its invalid
  blocks are the union of the ranks' (a block bad on one rank is recomputed);
- a disk save is durable once every rank reported it saved; a save that
  failed on any rank is reported failed (the scheduler forgets the key);
- bytes and failures add up.
"""
from __future__ import annotations

from collections import Counter

import msgspec
import torch
import torch.distributed as dist

from conveyor.engine.kv_connector.metadata import KVConnectorMetadata, KVConnectorOutput

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVConnectorOutput)


class RankMerge:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._load_blocks: dict[int, set[int]] = {}
        self._load_done: Counter[int] = Counter()
        self._load_invalid: dict[int, set[int]] = {}
        self._saved: Counter[bytes] = Counter()

    def note(self, meta: KVConnectorMetadata | None) -> None:
        """This step's transfers (every rank gets the same metadata)."""
        if meta is None:
            return
        for ld in meta.loads:
            self._load_blocks[ld.load_id] = set(ld.block_ids)
        # A key written (again) or deleted starts a fresh count.
        for key in [*meta.disk_deletes, *(s.key for s in meta.disk_saves), *(d.key for d in meta.demotes)]:
            self._saved.pop(key, None)

    def merge(self, reports: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        out = KVConnectorOutput()
        for r in reports:
            if r is not None:
                self._fold(r, out)
        for load_id, n in list(self._load_done.items()):
            if n >= self.world_size:
                del self._load_done[load_id]
                self._load_blocks.pop(load_id, None)
                out.finished_loads.append(load_id)
                out.invalid_block_ids += sorted(self._load_invalid.pop(load_id, set()))
        for key, n in list(self._saved.items()):
            if n >= self.world_size:
                del self._saved[key]
                out.disk_saved.append(key)
        return None if out.empty() else out

    def _fold(self, r: KVConnectorOutput, out: KVConnectorOutput) -> None:
        out.transfer_bytes += r.transfer_bytes
        out.transfer_failures += r.transfer_failures
        for key in r.failed_saves:
            self._saved.pop(key, None)
            if key not in out.failed_saves:
                out.failed_saves.append(key)
        for key in r.disk_saved:
            if key not in out.failed_saves:
                self._saved[key] += 1
        bad = set(r.invalid_block_ids)
        for load_id in r.finished_loads:
            self._load_done[load_id] += 1
            mine = self._load_blocks.get(load_id, set()) & bad
            if mine:
                self._load_invalid.setdefault(load_id, set()).update(mine)

    @property
    def num_pending(self) -> int:
        return len(self._load_done) + len(self._saved)


def gather_reports(report: KVConnectorOutput | None, group: dist.ProcessGroup | None,
                   world_size: int) -> list[KVConnectorOutput | None]:
    """Every rank's report, on every rank (two gloo all-gathers: lengths, bytes)."""
    payload = b"" if report is None else _ENCODER.encode(report)
    n = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, n, group=group)
    size = max(int(x.item()) for x in lengths)
    if size == 0:
        return [None] * world_size
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else 0
    parts = [torch.zeros(size, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(parts, mine, group=group)
    return [_DECODER.decode(p[:int(k.item())].numpy().tobytes()) if int(k.item()) else None
            for p, k in zip(parts, lengths)]
