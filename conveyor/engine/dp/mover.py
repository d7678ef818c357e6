"""How the data-parallel client (conveyor/engine/dp/client.py) moves a request
between engines without a record of its tokens.

The frontend's RequestState is the one record of the tokens a request has
delivered (conveyor/engine/frontend/output_processor.py). A move (its engine
lost or drained) is decided under the client's lock, on whichever thread saw
the cause: `move(src, ids, cause)`. At that instant the requests leave their
engine (later outputs of theirs there are dropped) and a ResumeCall goes to
the frontend through the output handler, under the same lock as every
delivery, so the frontend reaches it after each output it was handed before.
Its answer, `complete(tag, requests)` on the frontend's thread, brings the
requests back with exactly those tokens and the move completes: routed,
sent, recorded.

Invariants: a moving request is on no engine and in `moving` under the tag
of the one ask that moves it (an answer to an older ask of it is ignored);
an abort ends its move (`end`); an answer that finds no engine up parks the
request until one is (`unpark`). MoveBook holds per live request what a move
needs besides its tokens: its context length (prompt + tokens delivered, a
count) for the paced drain's waves, and when it last delivered (migration
gaps). The owner holds its lock around every method here but complete(),
which takes it.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, ResumeCall
from conveyor.engine.dp.migration_log import MigrationLog
from conveyor.engine.errors import EngineDeadError

MoveCause = Literal["lost", "drain"]
# place(request) -> the engine it was sent to; EngineDeadError when none is up.
Place = Callable[[EngineCoreRequest], int]


@dataclass
class _Entry:
    context: int  # prompt + output tokens delivered so far
    last_delivery: float  # when tokens last reached the frontend


@dataclass(frozen=True)
class Ask:
    src: int
    cause: MoveCause


# carry(request, ask) -> the request as its new engine gets it (with the KV
# its old engine left in the shared KV folder, when there is one).
Carry = Callable[[EngineCoreRequest, Ask], EngineCoreRequest]


class MoveBook:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request: EngineCoreRequest, now: float) -> None:
        n = len(request.prompt_token_ids) + len(request.output_token_ids)
        self._entries[request.request_id] = _Entry(n, now)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._entries.pop(rid, None)

    def absorb(self, outs: EngineCoreOutputs, now: float) -> None:
        """Outputs about to be delivered: count their tokens; forget the finished."""
        for o in outs.outputs:
            e = self._entries.get(o.request_id)
            if e is None:
                continue
            if o.finished:
                del self._entries[o.request_id]
            elif o.new_token_ids:
                e.context += len(o.new_token_ids)
                e.last_delivery = now

    def context(self, request_id: str) -> int:
        e = self._entries.get(request_id)
        return e.context if e is not None else 0

    def last_delivery(self, request_id: str) -> float | None:
        e = self._entries.get(request_id)
        return e.last_delivery if e is not None else None


class Mover:
    """The moves in flight: asked of the frontend, not yet answered (or
    answered while no engine was up: parked)."""

    def __init__(self, lock: threading.Lock, emit: Callable[[EngineCoreOutputs], None],
                 place: Place, migrations: MigrationLog, carry: Carry | None = None) -> None:
        self._lock, self._emit, self._place, self._migrations = lock, emit, place, migrations
        self._carry = carry
        self.book = MoveBook()
        self._asks: dict[int, Ask] = {}
        self.moving: dict[str, int] = {}  # request id -> the tag of the ask that moves it
        self.parked: dict[str, tuple[EngineCoreRequest, Ask]] = {}  # answered while no engine was up
        self._tags = itertools.count()
        self._answered = threading.Condition(lock)  # notified whenever an ask is answered

    def move(self, src: int, request_ids: list[str], cause: MoveCause) -> None:
        """Ask the frontend for these requests (off engine src) as delivered so far."""
        tag = next(self._tags)
        self._asks[tag] = Ask(src, cause)
        for rid in request_ids:
            self.moving[rid] = tag
        self._emit(EngineCoreOutputs(resume=ResumeCall(tag, list(request_ids))))

    def in_flight(self, request_id: str) -> bool:
        return request_id in self.moving or request_id in self.parked

    def complete(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        """The frontend's answer: place each request it was asked for."""
        with self._lock:
            ask = self._asks.pop(tag, None)
            if ask is None:
                return
            self._answered.notify_all()
            for r in requests:
                if self.moving.get(r.request_id) == tag:
                    del self.moving[r.request_id]
                    self._complete_one(r, ask)

    def _complete_one(self, r: EngineCoreRequest, ask: Ask) -> None:
        last = self.book.last_delivery(r.request_id) or time.monotonic()
        if self._carry is not None:
            r = self._carry(r, ask)
        try:
            dst = self._place(r)
        except EngineDeadError:  # no engine up now: it goes on once one is
            self.parked[r.request_id] = (r, ask)
            return
        self._migrations.record(r.request_id, ask.src, dst, ask.cause,
                                len(r.prompt_token_ids) + len(r.output_token_ids), last)

    def unpark(self) -> None:
        """An engine is up again: requests answered while none was go on."""
        parked, self.parked = self.parked, {}
        for r, ask in parked.values():
            self._complete_one(r, ask)

    def wait_answers(self, src: int, timeout_s: float) -> bool:
        """Under the lock: wait until every ask about engine src's requests
        is answered (their moves are counted then); False on timeout."""
        return self._answered.wait_for(
            lambda: not any(a.src == src for a in self._asks.values()), max(timeout_s, 0.0))

    def end(self, request_ids: list[str]) -> None:
        """Aborted: a move in progress ends here."""
        self.book.drop(request_ids)
        for rid in request_ids:
            self.moving.pop(rid, None)
            self.parked.pop(rid, None)
