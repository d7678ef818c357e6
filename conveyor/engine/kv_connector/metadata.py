"""What the scheduler side of a KV connector tells the workers each step, and
what the worker side reports back (msgspec: both cross processes).

Invariants the worker keeps, in this order at the start of a step, before
the forward: demotes, then disk deletes, then saves, then loads (a delete
names a key whose write went out in an earlier step; the scheduler drops an
unsent write instead of deleting it, so per key the disk sees writes and
deletes in the order they were decided). A save reads a
pool block before any step's forward may overwrite it (the scheduler sends it
in the step that reuses the block at the earliest); a load writes only blocks
the scheduler holds for that load until the load is reported finished.
"""
from __future__ import annotations

import msgspec

TIER_CPU = 0
TIER_DISK = 1
TIER_REMOTE = 2  # another engine's files in the shared KV folder (named by the request's KVTransfer)
TIER_NAMES = ("cpu", "disk", "remote")
TRANSFER_SOURCES = ("prefill", "migration", "peer")


class KVTransfer(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """KV another engine of the same model wrote for a request into the shared
    KV folder (`cache.offload_disk_path`): the first num_blocks full blocks of
    its tokens. A block that is missing (after waiting up to wait_s for it to
    land), torn or foreign fails its check and is recomputed, never used."""
    source: str  # one of TRANSFER_SOURCES (the reuse counter's label)
    num_blocks: int
    wait_s: float = 0.0


class BlockSave(msgspec.Struct, array_like=True, gc=False):
    key: bytes  # the block's chained hash (the tier key within one model identity)
    block_id: int = -1  # the pool block read (-1: a demote reads host slot `slot`)
    slot: int = -1  # the host slot written (a cpu save) or read (a demote)


class TierLoad(msgspec.Struct, array_like=True, gc=False):
    """Blocks of one request, in prefix order: keys[i] from tiers[i] (slot
    slots[i] for the host tier) into pool block block_ids[i]."""
    load_id: int
    req_id: str
    keys: list[bytes]
    tiers: list[int]
    slots: list[int]
    block_ids: list[int]
    wait_s: float = 0.0  # remote blocks may still be landing: a missing file is retried this long


class KVConnectorMetadata(msgspec.Struct, array_like=True, gc=False):
    demotes: list[BlockSave] = msgspec.field(default_factory=list)  # host slot -> disk
    cpu_saves: list[BlockSave] = msgspec.field(default_factory=list)  # pool -> host slot
    disk_saves: list[BlockSave] = msgspec.field(default_factory=list)  # pool -> disk
    disk_deletes: list[bytes] = msgspec.field(default_factory=list)
    loads: list[TierLoad] = msgspec.field(default_factory=list)

    def empty(self) -> bool:
        return not (self.demotes or self.cpu_saves or self.disk_saves or self.disk_deletes
                    or self.loads)


class KVConnectorOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's news from the worker side. A finished load lists the pool
    blocks that did not load (missing, failed their checksum, late, or a
    transfer error): the scheduler uses only the blocks before the first one."""
    finished_loads: list[int] = msgspec.field(default_factory=list)
    invalid_block_ids: list[int] = msgspec.field(default_factory=list)
    disk_saved: list[bytes] = msgspec.field(default_factory=list)  # durable on disk now
    failed_saves: list[bytes] = msgspec.field(default_factory=list)  # drop from the index
    transfer_bytes: int = 0
    transfer_failures: int = 0

    def empty(self) -> bool:
        return not (self.finished_loads or self.disk_saved or self.failed_saves
                    or self.transfer_bytes or self.transfer_failures)
