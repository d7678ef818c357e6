"""The scheduler's index of one KV tier: which block keys it holds, in LRU
order, within a capacity in blocks.

Invariants: len(entries) <= capacity; a host-tier entry owns one slot in
[0, capacity) and no two entries share a slot; an entry is loadable only
when ready (a disk entry becomes ready when the worker reports its file
durable); a pinned key (a load reads it this step) is never evicted.
A full tier evicts its least recently used unpinned entry and never raises;
when every entry is pinned, insert declines (the block is simply not kept).
Two kinds of pins: `pinned`, for this step (cleared when its metadata is
built), and `held`, per load in flight (released when the load finishes).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Entry:
    slot: int
    ready: bool


class TierIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU first
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self.pinned: set[bytes] = set()
        self.held: Counter[bytes] = Counter()
        # Told of every key that enters or leaves (the router's view of the tiers).
        self.on_add: Callable[[bytes], None] | None = None
        self.on_remove: Callable[[bytes], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def loadable(self, key: bytes) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.ready else None

    def release(self, key: bytes) -> None:
        self.held[key] -= 1
        if self.held[key] <= 0:
            del self.held[key]

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def insert(self, key: bytes, ready: bool) -> tuple[int, bytes | None, int] | None:
        """Add key (not present): (its slot, the evicted key or None, the
        evicted key's slot), or None when nothing can be evicted."""
        if not self.capacity:
            return None
        evicted, evicted_slot = None, -1
        if not self._free_slots:
            victim = next((k for k in self.entries if k not in self.pinned and k not in self.held), None)
            if victim is None:
                return None
            evicted, evicted_slot = victim, self.remove(victim)
        slot = self._free_slots.pop()
        self.entries[key] = Entry(slot, ready)
        if self.on_add is not None:
            self.on_add(key)
        return slot, evicted, evicted_slot

    def remove(self, key: bytes) -> int:
        """Drop key if present; returns its slot (-1 if absent)."""
        e = self.entries.pop(key, None)
        if e is None:
            return -1
        self.pinned.discard(key)
        self.held.pop(key, None)
        self._free_slots.append(e.slot)
        if self.on_remove is not None:
            self.on_remove(key)
        return e.slot

    def clear(self) -> None:
        if self.on_remove is not None:
            for key in self.entries:
                self.on_remove(key)
        self.entries.clear()
        self.pinned.clear()
        self.held.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
