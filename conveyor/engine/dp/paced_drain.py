"""Warm handover for a drain (conveyor/engine/dp/client.py): the drained engine keeps
decoding its streams while their new engines compute their contexts.

A plain move aborts every request on the drained engine at once and resubmits
them: the new engine then prefills all the moved contexts together, and every
moved stream waits for the whole batch of re-prefills (measured 11-13 x TPOT
with 31 streams moved, BENCHMARKS.md "Live migration"). Here each request is
first copied as a *warm-up* to its new engine: a request of its context
(prompt + tokens delivered so far) as prompt, one token, whose output nobody
sees, which leaves the context's full blocks in that engine's prefix cache.
When its warm-up ends, the request itself moves (abort on the old engine,
resubmit with the delivered tokens to the warmed engine); its prefill there
is what the old engine generated meanwhile plus the last partial block.
Moves thus spread over the steps the warm-ups finish in, and the old engine
serves every stream until its own move.

The contexts come from the frontend, the one record of delivered tokens: the
drain asks for them (conveyor/engine/dp/mover.py) and the warm-ups start on its
answer; each move asks again, for the tokens delivered by then.

Warm-ups run a few at a time per engine (a quarter of its step's token budget
of contexts), so that engine's own streams keep short steps.

Invariants: at most one warm-up per request; a warm-up whose request has
finished, moved or been aborted since is ignored when it ends; a warm-up's
engine lost meanwhile moves its requests at once, the plain way; warm-ups
are not counted as requests anywhere (no book entry, no router load).
The owner holds DataParallelClient._lock around every method here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.contracts import EngineCoreOutput, EngineCoreRequest
from conveyor.engine.dp.mover import WARM, Ask
from conveyor.engine.sampling_params import SamplingParams

WARM_SUFFIX = "~warm"


@dataclass
class _Warm:
    request_id: str
    src: int
    dst: int
    tokens: int = 0  # its context length (what the warm engine prefills)


class WarmHandover:
    """Mixin of DataParallelClient (uses its _live, router, clients, states, _ask, _move_off)."""

    _warming: dict[str, _Warm]  # sent, not ended
    _warm_queue: dict[int, list[tuple[EngineCoreRequest, _Warm]]]  # per warm engine: not yet sent

    def _warm_budget(self: Any) -> int:
        """Context tokens of warm-ups one engine computes at once: a quarter of
        its step budget, so its own streams' steps stay short (at least one
        warm-up is always in flight)."""
        return max(1, self.config.scheduler.max_num_batched_tokens // 4)

    def _send_warm(self: Any, dst: int) -> None:
        queue = self._warm_queue.get(dst) or []
        busy = sum(w.tokens for w in self._warming.values() if w.dst == dst)
        while queue and (busy == 0 or busy + queue[0][1].tokens <= self._warm_budget()):
            req, w = queue.pop(0)
            if self._live.get(w.request_id) != w.src:
                continue  # finished or moved while it queued
            self._warming[req.request_id] = w
            busy += w.tokens
            self.clients[dst].add_request(req)

    def _warm_off(self: Any, i: int) -> int:
        """Ask the frontend for the contexts of every request engine i owns
        (their warm-ups start on its answer); returns how many will move."""
        ids = [rid for rid, e in self._live.items() if e == i]
        if ids:
            self._ask(Ask(i, WARM), ids)
        return len(ids)

    def _warm_answer(self: Any, i: int, requests: list[EngineCoreRequest]) -> None:
        """The frontend's answer to _warm_off(i): a warm-up of each request
        still on drained engine i goes to the engine the router picks for it."""
        if self.states[i] != "drained":
            return  # undrained (they stay) or lost (they moved) meanwhile
        warming = {w.request_id for w in self._warming.values()}
        warming.update(w.request_id for queue in self._warm_queue.values() for _, w in queue)
        for r in requests:
            if self._live.get(r.request_id) != i or r.request_id in warming:
                continue
            dst = self._pick(r)
            if dst is None:  # no other engine up: the plain path reports it
                self._move_off(i, "drain")
                return
            warm = EngineCoreRequest(
                request_id=r.request_id + WARM_SUFFIX, prompt_token_ids=r.prompt_token_ids + r.output_token_ids,
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                arrival_time=r.arrival_time, priority=r.priority, eos_token_id=None,
                lora_request=r.lora_request, cache_salt=r.cache_salt)
            self._warm_queue.setdefault(dst, []).append(
                (warm, _Warm(r.request_id, i, dst, len(warm.prompt_token_ids))))
        for dst in list(self._warm_queue):
            self._send_warm(dst)

    def _pick(self: Any, r: EngineCoreRequest) -> int | None:
        """The engine the router would send the request to, not counted anywhere."""
        from conveyor.engine.dp.router.policy import block_hashes_of

        if sum(s == "up" for s in self.states) == 0:
            return None
        toks, lr = r.prompt_token_ids + r.output_token_ids, r.lora_request
        hashes = block_hashes_of(toks, self.kv_info.block_size, r.cache_salt,
                                 lr.lora_int_id if lr is not None else None) if self._hash else []
        return self.router.route(r.request_id, hashes, len(toks), 0, None,
                                 lr.lora_name if lr is not None else None, count=False).engine

    def _warm_outputs(self: Any, i: int, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Outputs of engine i less its warm-ups'; an ended warm-up moves its request."""
        if not self._warming:
            return outputs
        rest = []
        for o in outputs:
            w = self._warming.get(o.request_id)
            if w is None:
                rest.append(o)
            elif o.finished:
                del self._warming[o.request_id]
                self._move_one(w, i)
                self._send_warm(i)
        return rest

    def _move_one(self: Any, w: _Warm, dst: int | None) -> None:
        """Move the warm-up's request now (to dst, or where the router says)."""
        if self._live.get(w.request_id) != w.src:
            return  # it finished, was aborted, or moved (its engine was lost) meanwhile
        self._move_off(w.src, "drain", [w.request_id], prefer=dst)

    def _warm_engine_lost(self: Any, i: int) -> None:
        """Engine i is lost: warm-ups on it will never end, their requests move now;
        warm-ups of requests that lived on it are void."""
        waiting = [w for _, w in self._warm_queue.pop(i, [])]
        for wid, w in list(self._warming.items()):
            if w.dst == i:
                del self._warming[wid]
                waiting.append(w)
            elif w.src == i:
                del self._warming[wid]
        for w in waiting:
            self._move_one(w, None)
        for queue in self._warm_queue.values():  # the lost engine's own requests move plainly
            queue[:] = [(r, w) for r, w in queue if w.src != i]


@dataclass
class _Pace:
    queue: list[str]  # request ids still on the drained engine, in move order
    budget: int  # context tokens one wave moves at most (at least one request)
    wave: set[str] = field(default_factory=set)  # moved, no output from their new engine yet


class PacedDrain:
    """Mixin of DataParallelClient: a drain that moves its requests in waves.

    Moving every request at once makes its new engine prefill all the moved
    contexts in the same few steps, and every moved stream (and every stream
    already there) waits for all of them: 0.9-1.6 s for 31 streams on the
    2-core box, against a goal of 2 x TPOT + one context's prefill
    (BENCHMARKS.md "Live migration"). Here a wave holds at most the longest
    moved context's tokens; the next wave moves once each stream of the last
    one has an output from its new engine (its re-prefill is done). Until its
    wave the drained engine keeps decoding a stream, so no stream waits for
    more than its own wave's prefill plus a step on either side.

    Invariants: a request moves at most once per drain; a queued request
    that finished, was aborted or moved otherwise (its engine lost) is
    skipped; a wave stream that ends or moves elsewhere leaves the wave; the
    owner holds DataParallelClient._lock around every method here."""

    _paces: dict[int, _Pace]  # drained engine -> its handover in progress

    def _pace_off(self: Any, i: int) -> int:
        """Start moving engine i's requests; returns how many will move."""
        ids = [rid for rid, e in self._live.items() if e == i]
        if not ids:
            return 0
        longest = max(self.book.context(rid) for rid in ids)
        self._paces[i] = _Pace(ids, longest)
        self._next_wave(i)
        return len(ids)

    def _next_wave(self: Any, i: int) -> None:
        pace = self._paces[i]
        pace.queue = [rid for rid in pace.queue if self._live.get(rid) == i]
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
            pace.wave = set(wave)
            self._move_off(i, "drain", wave)

    def _pace_outputs(self: Any, outputs: list[EngineCoreOutput]) -> None:
        """Outputs just delivered (each from its request's owner): a wave
        whose streams all produced on their new engine lets the next move."""
        for i, pace in list(self._paces.items()):
            wave = pace.wave
            for o in outputs:
                wave.discard(o.request_id)
            if wave:  # a stream that ended meanwhile waits for nothing (a moving one is live)
                wave.difference_update([rid for rid in wave if rid not in self._live
                                        and rid not in self._moving and rid not in self._parked])
            if not wave and self.states[i] == "drained":
                self._next_wave(i)
