"""How the data-parallel client (conveyor/engine/dp/client.py) moves a request without
a record of its tokens.

The frontend's RequestState is the one record of the tokens a request has
delivered (conveyor/engine/frontend/output_processor.py). A move (its engine lost or drained,
a warm handover) is decided under the client's lock, on whichever thread saw
the cause. At that instant the request leaves its engine (later outputs of
it there are dropped) and a ResumeCall goes to the frontend through the
output handler, under the same lock as every delivery, so the frontend
reaches it after each output it was handed before. Its answer, resume() on
the frontend's thread, brings the request back with exactly those tokens and
the move completes: routed, sent, recorded. A warm handover asks the same
way for the contexts to warm (the requests stay where they are).

Invariants: a moving request is on no engine and in `_moving` under the tag
of the one ask that moves it (an answer to an older ask of it is ignored);
an abort ends its move; an answer that finds no engine up parks the request
until one is (`_unpark`). MoveBook holds per live request what a move needs
besides its tokens: its context length (prompt + tokens delivered, a count)
for the paced drain's waves, and when it last delivered (migration gaps).
The owner holds DataParallelClient._lock around every method here but
resume(), which takes it.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, ResumeCall
from conveyor.engine.errors import EngineDeadError

WARM = "warm"  # an ask that reads contexts for a warm handover (conveyor/engine/dp/paced_drain.py)


@dataclass
class _Entry:
    context: int  # prompt + output tokens delivered so far
    last_delivery: float  # when tokens last reached the frontend


@dataclass
class Ask:
    src: int
    cause: str  # "lost" | "drain" (a move) | WARM
    prefer: int | None = None  # a move's destination when it is up (a warmed engine)


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


class ResumeAsks:
    """Mixin of DataParallelClient (uses its _lock, _on_outputs, _place, migrations, book)."""

    _asks: dict[int, Ask]
    _moving: dict[str, int]  # request id -> the tag of the ask that moves it
    _parked: dict[str, tuple[EngineCoreRequest, Ask]]  # answered while no engine was up

    def _init_asks(self: Any) -> None:
        self._asks, self._moving, self._parked = {}, {}, {}
        self._tags = itertools.count()
        # Notified (under the client's lock) whenever an ask is answered.
        self._answered = threading.Condition(self._lock)

    def _ask(self: Any, ask: Ask, request_ids: list[str]) -> None:
        """Ask the frontend for these requests as delivered so far."""
        tag = next(self._tags)
        self._asks[tag] = ask
        if ask.cause != WARM:
            for rid in request_ids:
                self._moving[rid] = tag
        self._on_outputs(EngineCoreOutputs(resume=ResumeCall(tag, list(request_ids))))

    def resume(self: Any, tag: int, requests: list[EngineCoreRequest]) -> None:
        """The frontend's answer: complete the moves (or warm-ups) it was asked for."""
        with self._lock:
            ask = self._asks.pop(tag, None)
            if ask is None:
                return
            self._answered.notify_all()
            if ask.cause == WARM:
                self._warm_answer(ask.src, requests)
                return
            for r in requests:
                if self._moving.get(r.request_id) == tag:
                    del self._moving[r.request_id]
                    self._complete_move(r, ask)

    def _complete_move(self: Any, r: EngineCoreRequest, ask: Ask) -> None:
        last = self.book.last_delivery(r.request_id) or time.monotonic()
        try:
            dst = self._place(r, prefer=ask.prefer)
        except EngineDeadError:  # no engine up now: it goes on once one is
            self._parked[r.request_id] = (r, ask)
            return
        self.migrations.record(r.request_id, ask.src, dst, ask.cause,
                               len(r.prompt_token_ids) + len(r.output_token_ids), last)

    def _unpark(self: Any) -> None:
        """An engine is up again: requests answered while none was go on."""
        parked, self._parked = self._parked, {}
        for r, ask in parked.values():
            self._complete_move(r, ask)

    def _wait_answers(self: Any, src: int, timeout_s: float) -> bool:
        """Under the lock: wait until every ask about engine src's requests
        is answered (their moves are counted then); False on timeout."""
        return self._answered.wait_for(
            lambda: not any(a.src == src for a in self._asks.values()), max(timeout_s, 0.0))

    def _end_moves(self: Any, request_ids: list[str]) -> None:
        """Aborted: a move in progress ends here."""
        for rid in request_ids:
            self._moving.pop(rid, None)
            self._parked.pop(rid, None)
