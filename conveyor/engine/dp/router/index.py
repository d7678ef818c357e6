"""PrefixIndex: block hash -> the engines that hold it, from their event streams.

Owners are a bitmask per hash (bit e = engine e), so a request's prefix is
matched against every engine at once: walking its block hashes in order, an
engine drops out at the first block it lacks. Each engine also keeps its own
hashes in insertion order, to drop them all when its stream starts over and to
cap its share of memory (oldest first, as its LRU would have evicted them).

Stream rules per engine (conveyor/engine/dp/router/events.py): a new epoch drops the
engine's entries and expects seq 1; a seq that is not last + 1 is a gap: the
entries are dropped (a stale index would mispredict) and `apply` returns False,
so the caller asks that engine for a snapshot; events until then are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.dp.router.events import EngineLoad, KVEvents

# Measured (bench/routing/routing.py, tracemalloc, the synthetic trace on 8 engines:
# 127 bytes): one indexed (hash, engine) entry, i.e. the 32-byte hash as a
# bytes object (65), its slot in the owners dict and its mask, its slot in the
# engine's ordered dict. The index never holds more than the engines' caches
# do, and each engine's share is capped (max_blocks_per_engine).
BYTES_PER_BLOCK = 128


@dataclass
class EngineStream:
    epoch: int = 0
    seq: int = 0
    resyncing: bool = False
    held: dict[bytes, None] = field(default_factory=dict)  # insertion ordered
    load: EngineLoad = field(default_factory=EngineLoad)
    gaps: int = 0


class PrefixIndex:
    def __init__(self, max_blocks_per_engine: int = 1 << 20) -> None:
        if max_blocks_per_engine < 1:
            raise ValueError(f"max_blocks_per_engine must be >= 1, got {max_blocks_per_engine}")
        self.max_blocks_per_engine = max_blocks_per_engine
        self.owners: dict[bytes, int] = {}
        self.engines: dict[int, EngineStream] = {}

    # ---- engines ------------------------------------------------------------------

    def add_engine(self, e: int) -> None:
        self.engines.setdefault(e, EngineStream())

    def drop_engine(self, e: int) -> None:
        """The engine died or left: its entries go, its slot is kept empty."""
        st = self.engines.pop(e, None)
        if st is not None:
            self._forget_all(e, st)

    def _forget_all(self, e: int, st: EngineStream) -> None:
        bit, owners = 1 << e, self.owners
        for h in st.held:
            m = owners.get(h, 0) & ~bit
            if m:
                owners[h] = m
            else:
                owners.pop(h, None)
        st.held = {}

    # ---- events -------------------------------------------------------------------

    def apply(self, e: int, ev: KVEvents) -> bool:
        """Apply one message of engine e's stream; False: a gap, send a snapshot."""
        st = self.engines.get(e)
        if st is None:
            st = self.engines[e] = EngineStream()
        if ev.load is not None:
            st.load = ev.load
        if ev.epoch != st.epoch:
            self._forget_all(e, st)
            st.epoch, st.seq, st.resyncing = ev.epoch, 0, False
        if ev.snapshot:
            self._forget_all(e, st)
            st.seq, st.resyncing = ev.seq, False
            self._store(e, st, ev.stored)
            return True
        if ev.seq <= st.seq or st.resyncing:
            return True  # a repeat, or superseded by the snapshot on its way
        if ev.seq != st.seq + 1:
            st.gaps += 1
            st.resyncing = True
            self._forget_all(e, st)
            return False
        st.seq = ev.seq
        self._remove(e, st, ev.removed)
        self._store(e, st, ev.stored)
        return True

    def _store(self, e: int, st: EngineStream, hashes: list[bytes]) -> None:
        bit, owners, held = 1 << e, self.owners, st.held
        for h in hashes:
            if h in held:
                continue
            held[h] = None
            owners[h] = owners.get(h, 0) | bit
        over = len(held) - self.max_blocks_per_engine
        if over > 0:  # the cap: forget this engine's oldest entries
            self._remove(e, st, [h for h, _ in zip(held, range(over))])

    def _remove(self, e: int, st: EngineStream, hashes: list[bytes]) -> None:
        bit, owners, held = 1 << e, self.owners, st.held
        for h in hashes:
            if h not in held:
                continue
            del held[h]
            m = owners.get(h, 0) & ~bit
            if m:
                owners[h] = m
            else:
                owners.pop(h, None)

    # ---- queries ------------------------------------------------------------------

    def match(self, hashes: list[bytes], all_mask: int) -> dict[int, int]:
        """engine -> number of leading blocks of `hashes` it holds (engines
        holding none are left out)."""
        out: dict[int, int] = {}
        alive, owners = all_mask, self.owners
        for i, h in enumerate(hashes):
            m = owners.get(h, 0) & alive
            gone = alive & ~m
            if gone and i:
                _set_bits(out, gone, i)
            alive = m
            if not alive:
                return out
        if alive and hashes:
            _set_bits(out, alive, len(hashes))
        return out

    def run_from(self, hashes: list[bytes], e: int, start: int) -> int:
        """How many blocks of `hashes` from `start` on engine e holds, in a row."""
        bit, owners, n = 1 << e, self.owners, 0
        for h in hashes[start:]:
            if not owners.get(h, 0) & bit:
                break
            n += 1
        return n

    def num_entries(self) -> int:
        return sum(len(st.held) for st in self.engines.values())

    def size(self, e: int) -> int:
        st = self.engines.get(e)
        return len(st.held) if st is not None else 0


def _set_bits(out: dict[int, int], mask: int, value: int) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = value
        mask ^= low
