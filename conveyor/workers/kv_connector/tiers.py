"""The tier connector, worker side: the host tier's bytes and the disk I/O.

Per step, before the forward and in this order: demotes (host slot -> disk),
disk deletes, saves (pool -> disk, pool -> host slot), loads (host slot ->
pool at once; disk -> pool when the read arrives, at a later step's start).
Every host slot records the key it holds and a crc32 of its bytes; a load
checks both, a disk read checks its file's header and crc32: a block that
fails is reported invalid (and the rest of that load is not copied), so the
scheduler recomputes it; it is never used. An exception fails only the
blocks of the operation that raised it.
"""
from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.engine.kv_connector.disk_format import rank_folder
from conveyor.engine.kv_connector.metadata import (
    TIER_CPU,
    BlockSave,
    KVConnectorMetadata,
    KVConnectorOutput,
    TierLoad,
)
from conveyor.engine.kv_connector.spec import TierSpec
from conveyor.workers.kv_connector.base import KVConnectorWorker
from conveyor.workers.kv_connector.block_io import BlockCodec
from conveyor.workers.kv_connector.disk_io import DiskIO
from conveyor.workers.kv_connector.gpu_streams import SideStream

log = logging.getLogger(__name__)


@dataclass
class _DiskLoad:
    """A load whose disk blocks are being read: blocks [0, first_disk) are
    already in the pool (or invalid from `invalid_from`)."""
    load: TierLoad
    reads: dict[int, Future[bytes | None]]  # position in the load -> its read
    deadline: float
    invalid: list[int] = field(default_factory=list)


class TierConnectorWorker(KVConnectorWorker):
    """One rank's shard of every tier block: with several ranks (TP, PP) each
    keeps its own host rows (same slots) and its own disk folder
    (disk_format.rank_folder); conveyor/workers/kv_connector/rank_merge.py
    folds the ranks' reports into the engine's."""

    def __init__(self, spec: TierSpec, kv_caches: list[torch.Tensor], rank: int = 0,
                 world_size: int = 1) -> None:
        self.spec = spec
        self.codec = BlockCodec(kv_caches)
        if world_size == 1 and self.codec.bytes_per_block != spec.bytes_per_block:
            raise RuntimeError(f"KV tiers: a block is {self.codec.bytes_per_block} bytes here, "
                               f"{spec.bytes_per_block} in the engine's KVCacheInfo")
        nbytes = self.codec.bytes_per_block  # this rank's shard (PP stages differ)
        pin = bool(kv_caches) and kv_caches[0].is_cuda
        self.host = self.codec.new_rows(spec.cpu_blocks, pin) if spec.cpu_blocks else None
        self.slot_key: list[bytes | None] = [None] * spec.cpu_blocks
        self.slot_crc = [0] * spec.cpu_blocks
        self.disk = (DiskIO(rank_folder(spec.disk_folder, rank, world_size), spec.model_id, nbytes)
                     if spec.disk_folder is not None else None)
        self.nbytes = nbytes
        # CUDA: host-tier copies run on a side stream (gpu_streams.py); None on the CPU.
        self.side = SideStream(kv_caches[0].device) if pin else None
        self._disk_loads: list[_DiskLoad] = []
        self._out = KVConnectorOutput()

    # ---- the step ------------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if self.side is not None:  # last step's host saves: summed before anything reads a slot
            self._seal_saves(self.side.finish_saves())
        if meta is not None:
            for d in meta.demotes:
                self._guard([d.key], self._demote, d)
            for key in meta.disk_deletes:
                self._guard([key], self._disk().delete, key)
            for s in meta.disk_saves:
                self._guard([s.key], self._disk_save, s)
            if meta.cpu_saves:
                self._guard([s.key for s in meta.cpu_saves], self._cpu_saves, meta.cpu_saves)
            for ld in meta.loads:
                self._start_load(ld)
        if self.side is not None:
            self.side.before_forward()  # the forward waits for loads and save reads, not for D2H
        if self._disk_loads:
            self._finish_disk_loads()

    def get_output(self) -> KVConnectorOutput | None:
        if self.disk is not None:
            saved, failed = self.disk.finished_writes()
            self._out.disk_saved += saved
            self._out.failed_saves += failed
            self._out.transfer_failures += len(failed)
        out, self._out = self._out, KVConnectorOutput()
        return None if out.empty() else out

    def has_inflight(self) -> bool:
        return bool(self._disk_loads)

    def wait_idle(self, timeout_s: float) -> None:
        if not self._disk_loads:
            return
        futures = [f for p in self._disk_loads for f in p.reads.values()]
        wait(futures, timeout=timeout_s)  # releases the GIL: the readers run
        self._finish_disk_loads()

    def close(self) -> None:
        if self.side is not None:
            self._seal_saves(self.side.finish_saves())
        if self.disk is not None:
            self.disk.close()

    # ---- saves ---------------------------------------------------------------------

    def _guard(self, keys: list[bytes], fn: Callable[..., object], *args: object) -> None:
        """Run one transfer; an exception fails its blocks only."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a transfer error must not kill the step
            log.warning("KV tier transfer %s failed: %s", fn.__name__, e)
            self._out.failed_saves += keys
            self._out.transfer_failures += len(keys)

    def _disk(self) -> DiskIO:
        if self.disk is None:
            raise RuntimeError("no disk tier configured")
        return self.disk

    def _demote(self, d: BlockSave) -> None:
        assert self.host is not None  # demotes come from the host tier
        row = self.host[d.slot]
        if self.slot_key[d.slot] != d.key or _crc(row) != self.slot_crc[d.slot]:
            raise RuntimeError(f"host slot {d.slot} no longer holds the block to demote")
        self._disk().write(d.key, row.numpy().tobytes())
        self._out.transfer_bytes += self.nbytes

    def _disk_save(self, s: BlockSave) -> None:
        rows = self.codec.new_rows(1)
        self.codec.gather([s.block_id], rows)
        self._disk().write(s.key, rows[0].numpy().tobytes())
        self._out.transfer_bytes += self.nbytes

    def _cpu_saves(self, saves: list[BlockSave]) -> None:
        assert self.host is not None  # cpu saves come only with a host tier
        slots = [s.slot for s in saves]
        for s in saves:
            self.slot_key[s.slot] = None  # invalid until written and summed
        if self.side is not None:  # checked and summed at the next step's start
            self.side.save(self.codec, [s.block_id for s in saves], self.host, saves)
            return
        rows = self.codec.new_rows(len(saves))
        self.codec.gather([s.block_id for s in saves], rows)
        self.host[torch.tensor(slots, dtype=torch.long)] = rows
        self._seal_saves(saves)

    def _seal_saves(self, saves: list[BlockSave]) -> None:
        """The host rows of these saves hold their blocks now: name and sum them."""
        assert self.host is not None  # cpu saves come only with a host tier
        for s in saves:  # a slot saved twice in one step ends with the last save
            self.slot_key[s.slot] = s.key
            self.slot_crc[s.slot] = _crc(self.host[s.slot])
        self._out.transfer_bytes += len(saves) * self.nbytes

    # ---- loads ---------------------------------------------------------------------

    def _start_load(self, ld: TierLoad) -> None:
        reads: dict[int, Future[bytes | None]] = {}
        pending = _DiskLoad(ld, reads, time.monotonic() + self.spec.load_timeout_s)
        for i, tier in enumerate(ld.tiers):
            try:
                if tier != TIER_CPU:  # this engine's disk tier, or another engine's files
                    reads[i] = self._disk().read(ld.keys[i], ld.wait_s)
                elif not self._load_host(ld, i):
                    pending.invalid.append(ld.block_ids[i])
            except Exception as e:  # noqa: BLE001 - fails this load's blocks only
                log.warning("KV tier load %d failed: %s", ld.load_id, e)
                pending.invalid.append(ld.block_ids[i])
            if pending.invalid:
                break  # the prefix ends here: later blocks are recomputed anyway
        if reads:
            self._disk_loads.append(pending)
        else:
            self._finish(pending)

    def _load_host(self, ld: TierLoad, i: int) -> bool:
        assert self.host is not None  # cpu loads come only with a host tier
        slot = ld.slots[i]
        row = self.host[slot:slot + 1]
        if self.slot_key[slot] != ld.keys[i] or _crc(row) != self.slot_crc[slot]:
            log.warning("KV host tier: slot %d failed its check; block recomputed", slot)
            return False
        if self.side is not None:
            self.side.load(self.codec, row, ld.block_ids[i])
        else:
            self.codec.scatter(row, [ld.block_ids[i]])
        self._out.transfer_bytes += self.nbytes
        return True

    def _finish_disk_loads(self) -> None:
        """Copy the loads whose reads all arrived (or whose time ran out)."""
        now = time.monotonic()
        still = []
        for p in self._disk_loads:
            if now < p.deadline and not all(f.done() for f in p.reads.values()):
                still.append(p)
                continue
            for i, fut in sorted(p.reads.items()):
                if p.invalid and p.load.block_ids.index(p.invalid[0]) < i:
                    fut.cancel()  # past the end of the valid prefix
                    continue
                if not self._copy_read(p.load, i, fut):
                    p.invalid.append(p.load.block_ids[i])
            self._finish(p)
        self._disk_loads = still

    def _copy_read(self, ld: TierLoad, i: int, fut: Future[bytes | None]) -> bool:
        if not fut.done():
            return False  # late: recomputed; the read's result is never used
        try:
            payload = fut.result()
            if payload is None:
                return False
            row = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).view(1, -1)
            self.codec.scatter(row, [ld.block_ids[i]])
        except Exception as e:  # noqa: BLE001 - fails this block only
            log.warning("KV disk tier: loading block %d failed: %s", ld.block_ids[i], e)
            return False
        self._out.transfer_bytes += self.nbytes
        return True

    def _finish(self, p: _DiskLoad) -> None:
        self._out.finished_loads.append(p.load.load_id)
        if p.invalid:
            self._out.invalid_block_ids += p.invalid
            self._out.transfer_failures += 1


def _crc(rows: torch.Tensor) -> int:
    """crc32 of a host row's bytes (contiguous uint8 on the CPU)."""
    return zlib.crc32(rows.numpy().data)
