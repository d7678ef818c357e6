"""A drain that moves its requests in waves (parallel.paced_drain, on by default).

Moving every request at once makes its new engine prefill all the moved
contexts in the same few steps, and every moved stream (and every stream
already there) waits for all of them: 0.9-1.6 s for 31 streams on the 2-core
box, against a goal of 2 x TPOT + one context's prefill (BENCHMARKS.md "Live
migration"). Here a wave holds at most the longest moved context's tokens;
the next wave moves once each stream of the last one has an output from its
new engine (its re-prefill is done). Until its wave the drained engine keeps
decoding a stream, so no stream waits for more than its own wave's prefill
plus a step on either side.

Invariants: a request moves at most once per drain; a queued request that
finished, was aborted or moved otherwise (its engine lost) is skipped; a
wave stream that ends or moves elsewhere leaves the wave. The owner
(DataParallelClient) holds its lock around every method here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.engine.contracts import EngineCoreOutput
from conveyor.engine.dp.mover import MoveBook


@dataclass
class _Pace:
    queue: list[str]  # request ids still on the drained engine, in move order
    budget: int  # context tokens one wave moves at most (at least one request)
    wave: set[str] = field(default_factory=set)  # moved, no output from their new engine yet


@dataclass
class PacedDrains:
    """The paced drains in progress, one per drained engine.

    owner(rid): the engine a request is on (None: none); moving(rid): it is
    between engines; move(i, ids): take these requests off engine i now."""

    book: MoveBook
    owner: Callable[[str], int | None]
    moving: Callable[[str], bool]
    move: Callable[[int, list[str]], None]
    _paces: dict[int, _Pace] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self._paces)

    def start(self, i: int, ids: list[str]) -> int:
        """Start moving these requests of engine i; returns how many will move."""
        if not ids:
            return 0
        longest = max(self.book.context(rid) for rid in ids)
        self._paces[i] = _Pace(list(ids), longest)
        self._next_wave(i)
        return len(ids)

    def stop(self, i: int) -> None:
        """Engine i is undrained (what it still holds stays) or lost (all of it moves now)."""
        self._paces.pop(i, None)

    def _next_wave(self, i: int) -> None:
        pace = self._paces[i]
        pace.queue = [rid for rid in pace.queue if self.owner(rid) == i]
        wave: list[str] = []
        tokens = 0
        for rid in pace.queue:
            size = self.book.context(rid)
            if wave and tokens + size > pace.budget:
                break
            wave.append(rid)
            tokens += size
        taken = set(wave)
        pace.queue = [rid for rid in pace.queue if rid not in taken]
        if not pace.queue:
            del self._paces[i]
        if wave:
            pace.wave = taken
            self.move(i, wave)

    def on_outputs(self, outputs: list[EngineCoreOutput], drained: Callable[[int], bool]) -> None:
        """Outputs just delivered (each from its request's owner): a wave
        whose streams all produced on their new engine lets the next move."""
        for i, pace in list(self._paces.items()):
            wave = pace.wave
            for o in outputs:
                wave.discard(o.request_id)
            if wave:  # a stream that ended meanwhile waits for nothing (a moving one is live)
                wave.difference_update([rid for rid in wave if self.owner(rid) is None
                                        and not self.moving(rid)])
            if not wave and drained(i):
                self._next_wave(i)
