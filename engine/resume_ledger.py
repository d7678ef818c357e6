"""What a core client must remember to resubmit its requests to a new engine.

Invariant: for every request the frontend added and has neither aborted nor
seen finish, the ledger holds its EngineCoreRequest and exactly the tokens
that were handed to the frontend (absorb() runs before the outputs are
delivered). A resubmitted request carries those tokens
(EngineCoreRequest.output_token_ids), so the new engine goes on at the next
output position: nothing is duplicated or missing, and seeded draws (which
depend only on seed and output position) continue as if nothing happened.
Stop strings, n > 1 (each child is its own request), logprobs and usage
(the prefix-cache hit included) are the frontend's own state (RequestState),
which never leaves it; the ledger never edits the messages it records.

Why two records of tokens: the ledger is the only record of what to
resubmit, kept on the thread that delivers. The frontend's RequestState
(tokens, text, stops) is updated later, on the event loop, so at the moment
an actor is lost it may lack the messages still in flight to the loop:
resubmitting from it would repeat tokens the client then receives twice.

Two owners use it: RayCoreClient (resubmits to its rebuilt actor) and the
data-parallel client (migrates to another engine). Under data parallel the
latter is the only one that keeps tokens (an engine's RayCoreClient is built
with keep=False), so delivered tokens have exactly one record.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.contracts import EngineCoreOutputs, EngineCoreRequest


@dataclass
class _Entry:
    request: EngineCoreRequest
    output_token_ids: list[int] = field(default_factory=list)
    last_delivery: float = 0.0  # when tokens last reached the frontend (absorb's `now`)


class ResumeLedger:
    def __init__(self, keep: bool = True) -> None:
        # keep=False: add() records nothing (another ledger owns these requests).
        self.keep = keep
        self._entries: dict[str, _Entry] = {}  # insertion order = arrival order

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request: EngineCoreRequest, now: float = 0.0) -> None:
        if not self.keep:
            return
        self._entries[request.request_id] = _Entry(request, list(request.output_token_ids),
                                                 last_delivery=now)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._entries.pop(rid, None)

    def clear(self) -> None:
        self._entries.clear()

    def last_delivery(self, request_id: str) -> float | None:
        e = self._entries.get(request_id)
        return e.last_delivery if e is not None else None

    def absorb(self, outs: EngineCoreOutputs, now: float = 0.0) -> None:
        """Record the tokens about to be delivered; forget finished requests.
        The outputs go on as they are (the frontend's RequestState keeps the
        first prefix-cache hit it saw)."""
        entries = self._entries
        for o in outs.outputs:
            e = entries.get(o.request_id)
            if e is None:
                continue
            if o.finished:
                del entries[o.request_id]
            else:
                e.output_token_ids.extend(o.new_token_ids)
                if o.new_token_ids:
                    e.last_delivery = now

    def resubmissions(self, request_ids: list[str] | None = None) -> list[EngineCoreRequest]:
        """Every unfinished request (or those of `request_ids` it holds), in
        arrival order, with its delivered tokens."""
        entries = self._entries.values() if request_ids is None else \
            [e for rid in request_ids if (e := self._entries.get(rid)) is not None]
        return [msgspec.structs.replace(e.request, output_token_ids=list(e.output_token_ids))
                for e in entries]
