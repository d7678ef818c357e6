"""Prefill/decode disaggregation on the data-parallel engines (docs/disaggregation.md).

With parallel.prefill_engines = P, engines 0..P-1 prefill and the others
decode. A new request's prompt runs first as a *prefill leg* on a prefill
engine: a request of its own (id + LEG_SUFFIX, max_tokens 1, greedy) whose
output nobody sees; its blocks are written to the shared KV folder
(cache.offload_disk_path) when it finishes and leased there for
cache.kv_lease_s (`kv_lease_s` on the leg). Then the request itself goes to a
decode engine with a KVTransfer naming the prompt's full blocks: the decode
engine loads them (waiting for files still landing), checks each and
recomputes what fails, computes the prompt's last token and samples every
output token itself, so its tokens are exactly a colocated run's (greedy,
seeded, structured, n > 1: nothing of the leg's sampling is kept).

Failure: a leg whose engine is lost, whose finish is an error, or that has
not finished by its deadline (cache.kv_load_timeout_s) sends the request to
decode without a transfer (it recomputes the prompt); its leg is aborted
where the engine still lives. An abort ends both legs. Every leg ends
exactly once: finished, failed, expired or aborted.

The owner (DataParallelClient) holds its lock around every method here.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from conveyor.engine.dp.fleet import EngineState, Fleet
from conveyor.engine.dp.mover import Ask, Carry, Mover
from conveyor.engine.dp.router.policy import Decision, Router
from conveyor.engine.errors import EngineDeadError, KVLayoutMismatchError
from conveyor.engine.kv_connector.metadata import KVTransfer
from conveyor.engine.sampling_params import SamplingFields

log = logging.getLogger(__name__)
T = TypeVar("T")

LEG_SUFFIX = "#prefill"
# pull(request, its block hashes, the router's decision) -> the request as sent
PeerPull = Callable[[EngineCoreRequest, list[bytes], Decision], EngineCoreRequest]


def _leg_sampling() -> SamplingFields:
    """A leg's: one greedy token (a fresh object each: an in-process engine owns what it is sent)."""
    return SamplingFields(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class PDSettings:
    prefill_engines: int
    block_size: int
    lease_s: float  # the prefill engine keeps the leg's blocks this long
    deadline_s: float  # a leg not finished by then: decode recomputes

    def is_prefill(self, engine: int) -> bool:
        return engine < self.prefill_engines


@dataclass
class _Leg:
    request: EngineCoreRequest  # the request itself, as the frontend sent it
    engine: int
    deadline: float


class PrefillLegs:
    def __init__(self, s: PDSettings) -> None:
        self.s = s
        self._legs: dict[str, _Leg] = {}  # leg id -> its leg
        self.num_failed = 0  # legs that ended without a transfer (lost, error, late)

    def __len__(self) -> int:
        return len(self._legs)

    def wants_leg(self, request: EngineCoreRequest) -> bool:
        """A fresh request with at least one full block to hand over (a request
        that already has tokens, or asks for prompt logprobs, decodes directly)."""
        return (not request.output_token_ids and request.sampling_params.prompt_logprobs is None
                and (len(request.prompt_token_ids) - 1) // self.s.block_size >= 1)

    def start(self, request: EngineCoreRequest, engine: int, now: float) -> EngineCoreRequest:
        """The leg to send to prefill engine `engine`."""
        leg = msgspec.structs.replace(request, request_id=request.request_id + LEG_SUFFIX,
                                      sampling_params=_leg_sampling(), session=None,
                                      kv_lease_s=self.s.lease_s, kv_transfer=None)
        self._legs[leg.request_id] = _Leg(request, engine, now + self.s.deadline_s)
        return leg

    def engine_of(self, leg_id: str) -> int | None:
        leg = self._legs.get(leg_id)
        return leg.engine if leg is not None else None

    def finish(self, leg_id: str, ok: bool) -> EngineCoreRequest:
        """The leg ended: the request for decode, with the transfer when the
        prompt's blocks were written (ok), else as sent (its engine was lost,
        it failed or ran late: decode recomputes the prompt)."""
        request = self._legs.pop(leg_id).request
        if not ok:
            self.num_failed += 1
            return request
        n = len(request.prompt_token_ids) // self.s.block_size
        xf = KVTransfer("prefill", n, wait_s=min(self.s.lease_s, self.s.deadline_s))
        return msgspec.structs.replace(request, kv_transfer=xf)

    def on_engine(self, engine: int) -> list[str]:
        return [lid for lid, leg in self._legs.items() if leg.engine == engine]

    def per_engine(self) -> Counter[int]:
        """Legs in flight per prefill engine."""
        return Counter(leg.engine for leg in self._legs.values())

    def expired(self, now: float) -> list[str]:
        return [lid for lid, leg in self._legs.items() if leg.deadline <= now]

    def next_deadline(self) -> float | None:
        return min((leg.deadline for leg in self._legs.values()), default=None)

    def abort(self, request_ids: list[str]) -> list[tuple[int, str]]:
        """The requests end: (engine, leg id) of their legs, to abort there."""
        out = []
        for rid in request_ids:
            lid = rid + LEG_SUFFIX
            leg = self._legs.pop(lid, None)
            if leg is not None:
                out.append((leg.engine, lid))
        return out


def carry_kv(block_size: int, wait_s: float) -> Carry:
    """A drained engine's request moves with its KV: its old engine wrote the
    computed blocks to the shared KV folder when the move aborted it there;
    the new engine loads them and computes at most the last partial block.
    Only a request that delivered a token has its whole context computed (a
    waiting one recomputes); a lost engine's memory is gone: exact re-prefill."""
    def carry(request: EngineCoreRequest, ask: Ask) -> EngineCoreRequest:
        if ask.cause != "drain" or not request.output_token_ids:
            return request
        n = (len(request.prompt_token_ids) + len(request.output_token_ids) - 1) // block_size
        return msgspec.structs.replace(request, kv_transfer=KVTransfer("migration", n, wait_s=wait_s))
    return carry


def peer_pull(router: Router, block_size: int, min_tokens: int, wait_s: float) -> PeerPull:
    """cache.peer_fetch: when another engine's tiers hold at least min_tokens
    more of the prompt than the chosen engine has, the request names those
    blocks in the shared KV folder (a disk tier writes every finished
    request's blocks there; one still being written is waited for up to
    wait_s); a block that is not there fails its check and is recomputed."""
    def pull(request: EngineCoreRequest, hashes: list[bytes], d: Decision) -> EngineCoreRequest:
        if request.kv_transfer is not None or not hashes:
            return request
        n = len(request.prompt_token_ids) + len(request.output_token_ids)
        best = router.best_in_tiers_elsewhere(hashes, n, d.engine)
        if best - d.predicted_cached_tokens < min_tokens:
            return request
        return msgspec.structs.replace(request, kv_transfer=KVTransfer("peer", best // block_size, wait_s))
    return pull


def kv_layout(config: EngineConfig) -> dict[str, object]:
    """What must match for one engine to read another's blocks."""
    m, p, c = config.model, config.parallel, config.cache
    return {"model.path": m.path, "model.dtype": m.dtype, "model.quantization": m.quantization,
            "cache.block_size": c.block_size, "parallel.tensor_parallel_size": p.tensor_parallel_size,
            "parallel.pipeline_parallel_size": p.pipeline_parallel_size}


def check_kv_layout(base: EngineConfig) -> Callable[[EngineConfig], None]:
    """A check that refuses (KVLayoutMismatchError) an engine config whose KV
    layout differs from the fleet's: engines sharing a KV folder hand blocks to
    each other, so prefill and decode (and every engine a request may move to)
    keep one TP/PP layout, dtype and block size."""
    want = kv_layout(base)

    def check(config: EngineConfig) -> None:
        got = kv_layout(config)
        diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
        if diff:
            raise KVLayoutMismatchError(
                "an engine sharing the KV folder must keep the fleet's KV layout; differs: "
                + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()))
    return check


def checked_spawn(check: Callable[[EngineConfig], None], spawn: Callable[[EngineConfig], T]
                  ) -> Callable[[EngineConfig], T]:
    def checked(config: EngineConfig) -> T:
        check(config)  # before anything starts
        return spawn(config)
    return checked


class PDFlow:
    """The data-parallel client's P/D mechanism: starts legs, takes their
    outputs out of the stream, sends each request on to decode, and expires
    legs past their deadline (a watchdog thread, under the client's lock)."""

    def __init__(self, client: DPClientParts, s: PDSettings) -> None:
        self.c = client
        self.legs = PrefillLegs(s)
        self.s = s
        # Handed over, lease not yet released: request id -> ((prefill engine, its
        # incarnation), leg id); a lease of an engine since replaced went with it.
        self._handed: dict[str, tuple[tuple[int, int], str]] = {}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, name="conveyor-pd-legs", daemon=True)
        self._watch.start()

    def role(self, engine: int) -> str:
        return "prefill" if self.s.is_prefill(engine) else "decode"

    def decoders(self) -> list[int]:
        return [e for e in range(len(self.c.fleet)) if not self.s.is_prefill(e)]

    def add(self, request: EngineCoreRequest, hashes: list[bytes]) -> bool:
        """Start the request's prefill leg; False: it goes straight to decode."""
        if not self.legs.wants_leg(request):
            return False
        up = [e for e in self.c.fleet.up() if self.s.is_prefill(e)]
        if not up:
            return False  # no prefill engine: the decode engines prefill too
        lr = request.lora_request
        lid = request.request_id + LEG_SUFFIX
        d = self.c.router.route(lid, hashes, len(request.prompt_token_ids), 1, None,
                                lr.lora_name if lr is not None else None, only=up)
        leg = self.legs.start(request, d.engine, time.monotonic())
        try:
            self.c.fleet.client(d.engine).add_request(leg)
        except EngineDeadError:
            self.legs.finish(lid, ok=False)
            self.c.router.finish(lid)
            return False
        return True

    def intercept(self, engine: int, outs: EngineCoreOutputs) -> None:
        """Take the legs' outputs out of engine's outputs; a finished leg sends its request to decode."""
        keep = []
        for o in outs.outputs:
            if not o.request_id.endswith(LEG_SUFFIX):
                keep.append(o)
                if o.request_id in self._handed and (o.new_token_ids or o.finished):
                    self._release(o.request_id)  # decode computed on the KV: the lease may end
            elif o.finished and self.legs.engine_of(o.request_id) == engine:
                self.c.router.finish(o.request_id)
                ok = o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                request = self.legs.finish(o.request_id, ok)
                if ok:
                    self._handed[request.request_id] = (self._identity(engine), o.request_id)
                self._to_decode(request)
        outs.outputs = keep

    def _identity(self, engine: int) -> tuple[int, int]:
        return engine, self.c.fleet.slots[engine].incarnation

    def _release(self, request_id: str) -> None:
        """Abort the finished leg on its engine: what ends its lease there."""
        who, lid = self._handed.pop(request_id)
        if self._identity(who[0]) == who:
            self._abort_leg(who[0], lid)

    def _abort_leg(self, engine: int, lid: str) -> None:
        """Tell a prefill engine to drop a leg. Called on output threads under
        the client's lock, so it never raises: an engine that died meanwhile
        took the leg (and its lease) with it, and its loss is handled apart."""
        if self.c.fleet.state(engine) is not EngineState.UP:
            return
        try:
            self.c.fleet.client(engine).abort_requests([lid])
        except EngineDeadError as e:
            log.info("prefill engine %d gone while dropping leg %s: %s", engine, lid, e)

    def engine_lost(self, engine: int) -> None:
        for rid in [r for r, (who, _) in self._handed.items() if who[0] == engine]:
            del self._handed[rid]  # its leases went with it
        for lid in self.legs.on_engine(engine):
            self.c.router.finish(lid)
            self._to_decode(self.legs.finish(lid, ok=False))

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._handed:
                self._release(rid)
        for e, lid in self.legs.abort(request_ids):
            self.c.router.finish(lid)
            self._abort_leg(e, lid)

    def _expire(self, lid: str) -> None:
        e = self.legs.engine_of(lid)
        self.c.router.finish(lid)
        request = self.legs.finish(lid, ok=False)
        log.warning("prefill leg of %s on engine %s not finished within %.1f s; decode recomputes it",
                    request.request_id, e, self.s.deadline_s)
        if e is not None:
            self._abort_leg(e, lid)
        self._to_decode(request)

    def _to_decode(self, request: EngineCoreRequest) -> None:
        try:
            self.c._place(request)
        except EngineDeadError as e:  # no decode engine up: the request ends with the error
            self.c.mover.book.drop([request.request_id])
            self.c._emit(EngineCoreOutputs([EngineCoreOutput(request.request_id, [],
                                                             finish_reason=FinishReason.ERROR)],
                                           engine_error=None))
            log.error("request %s: no decode engine to take it: %s", request.request_id, e)

    def expire(self, now: float) -> int:
        """End the legs past their deadline at `now` (under the client's lock)."""
        late = self.legs.expired(now)
        for lid in late:
            self._expire(lid)
        return len(late)

    def _watchdog(self) -> None:
        while not self._stop.wait(self._pause()):
            with self.c._lock:
                self.expire(time.monotonic())

    def _pause(self) -> float:
        nxt = self.legs.next_deadline()
        return 0.5 if nxt is None else min(max(nxt - time.monotonic(), 0.005), 0.5)

    def stop(self) -> None:
        self._stop.set()


class DPClientParts(Protocol):
    """What PDFlow uses of the DataParallelClient (conveyor/engine/dp/client.py)."""
    fleet: Fleet
    router: Router
    mover: Mover
    _lock: threading.Lock

    def _place(self, request: EngineCoreRequest) -> int: ...
    def _emit(self, outs: EngineCoreOutputs) -> None: ...
