"""The tier connector, scheduler side: a host-memory tier and a disk tier
below the paged pool.

A computed block the pool evicts moves down to the host tier (the host
tier's own LRU victim moves on to disk when there is one); a finished
request's computed blocks are written to disk (so a restarted engine finds
them). A later prefix that misses the pool but hits a tier is loaded back.
This side owns the index of both tiers; the worker side
(conveyor/workers/kv_connector/tiers.py) owns their bytes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.engine.core.request import Request
from conveyor.engine.kv_connector import disk_format
from conveyor.engine.kv_connector.base import KVConnectorScheduler, LoadResult, TierStats
from conveyor.engine.kv_connector.metadata import (
    TIER_CPU,
    TIER_DISK,
    TIER_NAMES,
    TIER_REMOTE,
    BlockSave,
    KVConnectorMetadata,
    KVConnectorOutput,
    TierLoad,
)
from conveyor.engine.kv_connector.spec import TierSpec
from conveyor.engine.kv_connector.tier_index import TierIndex


class TierEvents(Protocol):
    """Where the tiers' keys are reported (conveyor/engine/dp/router/events.py's publisher)."""

    def attach_tiers(self, tier_keys: Callable[[], list[bytes]]) -> None: ...
    def tier_stored(self, block_hash: bytes) -> None: ...
    def tier_removed(self, block_hash: bytes) -> None: ...


@dataclass
class _Load:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    tiers: list[int]
    disk_keys: list[bytes]  # pinned on disk until the load finishes
    source: str = ""  # the remote blocks' KVTransfer.source


class TierConnectorScheduler(KVConnectorScheduler):
    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.cpu = TierIndex(spec.cpu_blocks)
        self.disk = TierIndex(spec.disk_blocks)
        self._meta = KVConnectorMetadata()
        self._loads: dict[int, _Load] = {}
        self._next_load_id = 0
        # Requests whose tier load was given up: they recompute, never retry a tier.
        self._no_tier: set[str] = set()
        # Requests one of whose blocks from another engine failed (missing, bad,
        # late): they never ask that engine again, preempted or not. Their
        # KVTransfer stays on the request, so without this every re-admission
        # waited out wait_s for the same missing files, forever.
        self._no_remote: set[str] = set()
        self._stats = TierStats()
        # Leases (prefill legs): request id -> (until, keys held on disk for another engine).
        self._leases: dict[str, tuple[float, list[bytes]]] = {}
        self.clock: Callable[[], float] = time.monotonic  # leases' deadlines (tests set their own)
        self.events: TierEvents | None = None
        for index, other in ((self.cpu, self.disk), (self.disk, self.cpu)):
            index.on_add = lambda key, other=other: self._tier_changed(key, other, True)
            index.on_remove = lambda key, other=other: self._tier_changed(key, other, False)
        if spec.disk_folder is not None:
            # A restart finds what was written (every rank's shard of it).
            for key in disk_format.scan_ranks(spec.disk_folder, spec.world_size):
                self._disk_insert(key, ready=True)

    # ---- the router's view -----------------------------------------------------------

    def attach_events(self, events: TierEvents) -> None:
        self.events = events
        events.attach_tiers(self.tier_keys)

    def tier_keys(self) -> list[bytes]:
        return list(dict.fromkeys([*self.cpu.entries, *self.disk.entries]))

    def _tier_changed(self, key: bytes, other: TierIndex, added: bool) -> None:
        """A key is in the tiers while either index holds it."""
        if self.events is None or key in other:
            return
        if added:
            self.events.tier_stored(key)
        else:
            self.events.tier_removed(key)

    # ---- lookups and loads ---------------------------------------------------------

    def _loadable_tier(self, key: bytes) -> int:
        if self.cpu.loadable(key) is not None:
            return TIER_CPU
        if self.disk.loadable(key) is not None:
            return TIER_DISK
        return -1

    def _tier_of(self, request: Request, i: int, key: bytes) -> int:
        """Where block i of the request loads from: a tier of this engine, else
        another engine's file that its KVTransfer names, else -1."""
        tier = self._loadable_tier(key)
        xf = request.kv_transfer
        if tier < 0 and xf is not None and i < xf.num_blocks and self.spec.disk_folder is not None \
                and request.request_id not in self._no_remote:
            return TIER_REMOTE
        return tier

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> tuple[int, bool]:
        if request.request_id in self._no_tier or request.prompt_logprobs is not None:
            return 0, False
        bs = self.spec.block_size
        n = 0
        start = num_local_computed // bs
        # Capped like a local hit: the last token is computed to produce logits.
        for i, key in enumerate(request.block_hashes[start:(request.num_tokens - 1) // bs], start):
            tier = self._tier_of(request, i, key)
            if tier < 0:
                break
            if tier != TIER_REMOTE:
                # Kept until the step is built: allocating the load's blocks evicts
                # pool blocks into the tiers, which must not push these out.
                (self.cpu if tier == TIER_CPU else self.disk).pinned.add(key)
            n += 1
        return n * bs, n > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> int:
        bs = self.spec.block_size
        start = request.num_computed_tokens // bs
        keys = request.block_hashes[start:start + num_external_tokens // bs]
        xf = request.kv_transfer
        load = TierLoad(self._next_load_id, request.request_id, [], [], [], [],
                        wait_s=xf.wait_s if xf is not None else 0.0)
        self._next_load_id += 1
        disk_keys = []
        for i, key in enumerate(keys, start):
            tier = self._tier_of(request, i, key)
            if tier < 0:  # cannot happen while lookups pin; the load just ends here
                break
            load.keys.append(key)
            load.block_ids.append(block_ids[i])
            load.tiers.append(tier)
            load.slots.append(self.cpu.entries[key].slot if tier == TIER_CPU else -1)
            if tier == TIER_CPU:
                self.cpu.touch(key)
            elif tier == TIER_DISK:
                self.disk.touch(key)
                disk_keys.append(key)
                self.disk.held[key] += 1  # read over several steps
        self._meta.loads.append(load)
        self._loads[load.load_id] = _Load(request.request_id, load.keys, load.block_ids, load.tiers, disk_keys,
                                          xf.source if xf is not None else "")
        return load.load_id

    def give_up_load(self, load_id: int, request_id: str) -> None:
        self._no_tier.add(request_id)

    def request_reset(self, request_id: str) -> None:
        self._no_tier.discard(request_id)

    # ---- saves ---------------------------------------------------------------------

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.cpu.capacity:
            self._cpu_save(block_id, block_hash)
        elif self.disk.capacity and block_hash not in self.disk:
            self._disk_save(block_id, block_hash)

    def _cpu_save(self, block_id: int, key: bytes) -> None:
        if key in self.cpu:
            self.cpu.touch(key)
            return
        placed = self.cpu.insert(key, ready=True)
        if placed is None:
            return  # every host slot is read by a load this step: not kept
        slot, victim, victim_slot = placed
        if victim is not None and self.disk.capacity and victim not in self.disk:
            if self._disk_insert(victim, ready=False):  # the worker demotes before it overwrites
                self._meta.demotes.append(BlockSave(victim, -1, victim_slot))
        self._meta.cpu_saves.append(BlockSave(key, block_id, slot))

    def _disk_save(self, block_id: int, key: bytes) -> None:
        if self._disk_insert(key, ready=False):
            self._meta.disk_saves.append(BlockSave(key, block_id, -1))

    def _disk_insert(self, key: bytes, ready: bool) -> bool:
        self._end_leases()
        placed = self.disk.insert(key, ready)
        if placed is None:
            return False
        victim = placed[1]
        if victim is not None:
            m = self._meta
            unsent = len(m.disk_saves) + len(m.demotes)
            m.disk_saves = [x for x in m.disk_saves if x.key != victim]
            m.demotes = [x for x in m.demotes if x.key != victim]
            if unsent == len(m.disk_saves) + len(m.demotes):
                # Written in an earlier step: the writer thread deletes it after that write.
                m.disk_deletes.append(victim)
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """block_ids: the request's computed (hashed) blocks, in order. They
        go to disk now (copied at the next step's start, before any reuse)."""
        self._no_tier.discard(request.request_id)
        self._no_remote.discard(request.request_id)
        if not self.disk.capacity:
            return False, None
        xf = request.kv_transfer
        theirs = xf.num_blocks if xf is not None else 0  # another engine wrote (and owns) these
        for key, block_id in list(zip(request.block_hashes, block_ids))[theirs:]:
            if key in self.disk:
                self.disk.touch(key)
            else:
                self._disk_save(block_id, key)
        if request.kv_lease_s > 0:  # a prefill leg: its blocks stay for the decode engine
            keys = [k for k in request.block_hashes[:len(block_ids)] if k in self.disk]
            for key in keys:
                self.disk.held[key] += 1
            self._leases[request.request_id] = (self.clock() + request.kv_lease_s, keys)
        return False, None

    def _end_leases(self) -> None:
        if self._leases:
            now = self.clock()
            for rid in [r for r, (until, _) in self._leases.items() if until <= now]:
                self.release_lease(rid)

    def release_lease(self, request_id: str) -> None:
        _, keys = self._leases.pop(request_id, (0.0, []))
        for key in keys:
            if key in self.disk:
                self.disk.release(key)

    # ---- the step ------------------------------------------------------------------

    def has_pending(self) -> bool:
        return not self._meta.empty()

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        self._end_leases()
        meta, self._meta = self._meta, KVConnectorMetadata()
        self.cpu.pinned.clear()  # the worker reads host slots at this step's start
        self.disk.pinned.clear()
        return None if meta.empty() else meta

    def update_connector_output(self, out: KVConnectorOutput) -> list[LoadResult]:
        st = self._stats
        st.transfer_bytes += out.transfer_bytes
        st.transfer_failures += out.transfer_failures
        for key in out.disk_saved:
            e = self.disk.entries.get(key)
            if e is not None:
                e.ready = True
        for key in out.failed_saves:
            self.cpu.remove(key)
            self.disk.remove(key)
        invalid = set(out.invalid_block_ids)
        results = []
        for load_id in out.finished_loads:
            ld = self._loads.pop(load_id, None)
            if ld is None:
                continue
            for key in ld.disk_keys:
                if key in self.disk:
                    self.disk.release(key)
            n = next((i for i, b in enumerate(ld.block_ids) if b in invalid), len(ld.block_ids))
            if n < len(ld.block_ids):
                self._drop_bad(ld.keys[n], ld.tiers[n], ld.req_id)
            by_source: dict[str, int] = {}
            for tier in ld.tiers[:n]:
                name = ld.source if tier == TIER_REMOTE else TIER_NAMES[tier]
                by_source[name] = by_source.get(name, 0) + self.spec.block_size
            results.append(LoadResult(load_id, ld.req_id, n * self.spec.block_size, by_source,
                                      n * self.spec.bytes_per_block))
        return results

    def _drop_bad(self, key: bytes, tier: int, request_id: str) -> None:
        """A block that failed its load is not offered again (a retry would fail the same way):
        a tier's copy leaves the index; another engine's is not asked for by this request again."""
        if tier == TIER_CPU:
            self.cpu.remove(key)
        elif tier == TIER_DISK and self.disk.remove(key) >= 0:
            self._meta.disk_deletes.append(key)
        elif tier == TIER_REMOTE:
            self._no_remote.add(request_id)

    def reset(self, lost_workers: bool) -> None:
        """Host slots are gone with the workers (and stale after a prefix-cache
        reset); disk files stay, except those whose write may have died."""
        self.cpu.clear()
        self._meta = KVConnectorMetadata()
        self._loads.clear()
        self._no_tier.clear()
        self._no_remote.clear()
        self.disk.pinned.clear()
        self.disk.held.clear()
        self._leases.clear()
        if lost_workers:
            for key in [k for k, e in self.disk.entries.items() if not e.ready]:
                self.disk.remove(key)

    def take_stats(self) -> TierStats:
        st, self._stats = self._stats, TierStats()
        st.tier_blocks = {"cpu": len(self.cpu), "disk": len(self.disk)}
        return st

    @property
    def num_inflight_loads(self) -> int:
        return len(self._loads)
