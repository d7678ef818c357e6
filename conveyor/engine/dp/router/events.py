"""What an engine tells the router: its cached block hashes and its load.

An engine's stream is a sequence of `KVEvents`, numbered 1, 2, ... within an
epoch. The epoch is drawn at random when the stream starts and again whenever
the engine's prefix cache starts over (reset_prefix_cache, a rebuilt worker
group, a new engine actor): a new epoch tells the router to drop everything it
knew about that engine. A full snapshot (`snapshot=True`: `stored` is every
hash the engine holds) is sent on request, after the router saw a gap.

The hashes are the engine's own (conveyor/engine/kv_cache/hashing.py: the chained
sha256 with the cache salt in block 0), taken where its BlockPool maps a hash
to a block and where it drops the last block of a hash: nothing re-derived.
msgspec structs: they ride the engine's output channel with EngineCoreOutputs.
"""
from __future__ import annotations

import random

import msgspec


class EngineLoad(msgspec.Struct, array_like=True, gc=False, frozen=True):
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0


class KVEvents(msgspec.Struct, array_like=True, gc=False):
    epoch: int
    seq: int
    stored: list[bytes] = msgspec.field(default_factory=list)
    removed: list[bytes] = msgspec.field(default_factory=list)
    load: EngineLoad | None = None
    snapshot: bool = False


def _new_epoch(rng: random.Random) -> int:
    return rng.getrandbits(62) + 1


class KVEventPublisher:
    """Collects one engine's store/evict events between two drains (called
    on the engine's step thread only)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.epoch = _new_epoch(self._rng)
        self.seq = 0
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._announce = True  # a new epoch is announced even without events
        self._last_load: EngineLoad | None = None

    def stored(self, block_hash: bytes) -> None:
        self._stored.append(block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        """The engine's prefix cache starts over: a new epoch."""
        self.epoch = _new_epoch(self._rng)
        self.seq = 0
        self._stored, self._removed = [], []
        self._announce = True

    def drain(self, load: EngineLoad | None) -> KVEvents | None:
        """The events since the last drain (None when nothing changed)."""
        if not (self._stored or self._removed or self._announce) and load == self._last_load:
            return None
        self.seq += 1
        ev = KVEvents(self.epoch, self.seq, self._stored, self._removed, load)
        self._stored, self._removed, self._announce = [], [], False
        self._last_load = load
        return ev

    def snapshot(self, hashes: list[bytes], load: EngineLoad | None) -> KVEvents:
        """Every hash the engine holds now; pending events are folded in
        (`hashes` already reflects them)."""
        self.seq += 1
        self._stored, self._removed, self._announce = [], [], False
        self._last_load = load
        return KVEvents(self.epoch, self.seq, list(hashes), [], load, snapshot=True)
