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
A KV tier below the pool (conveyor/engine/kv_connector/) reports its keys in
`tier_stored` / `tier_removed`: a hash is stored when it enters the engine's
tiers and removed when it has left all of them. A new epoch (or a snapshot)
re-announces every tier key, since tiers (disk) outlive the pool's cache.
msgspec structs: they ride the engine's output channel with EngineCoreOutputs.
"""
from __future__ import annotations

import random
from collections.abc import Callable

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
    tier_stored: list[bytes] = msgspec.field(default_factory=list)
    tier_removed: list[bytes] = msgspec.field(default_factory=list)


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
        # Tier key -> in the tiers now: the last change of a key wins, so a
        # key that came and went between two drains is sent once, as it is.
        self._tier_delta: dict[bytes, bool] = {}
        # Every key the engine's KV tiers hold now (set by the tier connector).
        self.tier_keys: Callable[[], list[bytes]] | None = None

    def attach_tiers(self, tier_keys: Callable[[], list[bytes]]) -> None:
        """The engine's tiers report here from now on; a new epoch not yet
        sent carries every key they hold (a restart's disk tier included)."""
        self.tier_keys = tier_keys
        if self._announce:
            self._tier_delta = dict.fromkeys(self._tier_all(), True)

    def _tier_all(self) -> list[bytes]:
        return self.tier_keys() if self.tier_keys is not None else []

    def stored(self, block_hash: bytes) -> None:
        self._stored.append(block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._removed.append(block_hash)

    def tier_stored(self, block_hash: bytes) -> None:
        self._tier_delta[block_hash] = True

    def tier_removed(self, block_hash: bytes) -> None:
        self._tier_delta[block_hash] = False

    def cleared(self) -> None:
        """The engine's prefix cache starts over: a new epoch."""
        self.epoch = _new_epoch(self._rng)
        self.seq = 0
        self._stored, self._removed = [], []
        self._tier_delta = dict.fromkeys(self._tier_all(), True)
        self._announce = True

    def drain(self, load: EngineLoad | None) -> KVEvents | None:
        """The events since the last drain (None when nothing changed)."""
        changed = self._stored or self._removed or self._tier_delta
        if not (changed or self._announce) and load == self._last_load:
            return None
        self.seq += 1
        delta = self._tier_delta
        ev = KVEvents(self.epoch, self.seq, self._stored, self._removed, load,
                      tier_stored=[k for k, v in delta.items() if v],
                      tier_removed=[k for k, v in delta.items() if not v])
        self._stored, self._removed, self._announce, self._tier_delta = [], [], False, {}
        self._last_load = load
        return ev

    def snapshot(self, hashes: list[bytes], load: EngineLoad | None) -> KVEvents:
        """Every hash the engine holds now; pending events are folded in
        (`hashes` already reflects them)."""
        self.seq += 1
        self._stored, self._removed, self._announce = [], [], False
        self._tier_delta = {}
        self._last_load = load
        return KVEvents(self.epoch, self.seq, list(hashes), [], load, snapshot=True,
                        tier_stored=self._tier_all())
