"""DataParallelClient: N independent engine cores behind one frontend.

A CoreClient (conveyor/engine/core_client.py), so the blocking LLM (through
SyncCoreEngine) and AsyncLLM (offline, Serve, batch) drive N engines exactly
as they drive one, and its own FleetAdmin (`admin`). `add_request` asks the
router (router/policy.py) which engine takes the request, counts it there at
once and hands it to that engine's client; every engine's outputs go to the
frontend's one handler, after their prefix-cache events have fed the router's
index (a gap asks that engine for a snapshot) and finished requests have
released their load.

Parts, each owning its state: the Fleet (fleet.py: each slot's client, state
and last stats), the Router, the Mover (mover.py: moves between engines) and
PacedDrains (paced_drain.py), and the FleetScaler (scaling.py: add, remove,
rollout, autoscaling). One lock, `_lock`, over routing, the moves, engine
states and delivery: an output is checked against its request's owner,
recorded and handed on in one piece, so a move never interleaves with a
delivery. The router is called from the frontend's thread and from the
engines' output threads, always under it.

Each engine is a client from `spawn`: an in-process core (executor "uniproc"
becomes "mp" per engine, conveyor/engine/dp/fleet.py engine_config) or an
EngineCoreActor. With data_parallel_size 1 nothing here runs (no extra hop).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest
from conveyor.engine.core_client import CoreClient, FleetAdmin, MetricRow, OutputHandler
from conveyor.engine.dp.admin_view import engine_rows, fleet_metric_rows
from conveyor.engine.dp.disagg import PDFlow, PDSettings, carry_kv, check_kv_layout, checked_spawn, peer_pull
from conveyor.engine.dp.fleet import EngineState, Fleet, Vacant
from conveyor.engine.dp.migration_log import MigrationLog
from conveyor.engine.dp.mover import MoveCause, Mover
from conveyor.engine.dp.paced_drain import PacedDrains
from conveyor.engine.dp.router.policy import Router, RouterSettings, block_hashes_of
from conveyor.engine.dp.scaling import FleetScaler
from conveyor.engine.errors import DeadFlag, EngineDeadError
from conveyor.engine.sampling_params import resolved_max_tokens

log = logging.getLogger(__name__)
UP, DRAINED, LOST, DEAD, OFF = (EngineState.UP, EngineState.DRAINED, EngineState.LOST,
                                EngineState.DEAD, EngineState.OFF)
Spawn = Callable[[EngineConfig], CoreClient]


class DataParallelClient:
    started_ray = False  # its engines' clients own Ray, not this one

    def __init__(self, config: EngineConfig, spawn: Spawn, fleet: Fleet | None = None) -> None:
        """spawn(config) makes one engine's client (also for replace and add);
        `fleet`: engines started already (else data_parallel_size from spawn)."""
        self.config = config
        cc = config.cache
        shared_kv = cc.enable_prefix_caching and bool(cc.offload_disk_path) and cc.offload_disk_gb > 0
        # Engines that hand KV to each other keep one KV layout: a new one must match.
        self._layout = check_kv_layout(config) if shared_kv else None
        self.spawn = checked_spawn(self._layout, spawn) if self._layout is not None else spawn
        self.fleet = fleet if fleet is not None else Fleet.start(config, spawn)
        self._on_outputs: OutputHandler | None = None
        self.kv_info = self.fleet.client(0).kv_info
        self.router = Router(RouterSettings(policy=config.serve.router, block_size=self.kv_info.block_size,
                                            seed=config.model.seed), len(self.fleet))
        self._hash = cc.enable_prefix_caching and (config.serve.router in ("kv_aware", "session") or cc.peer_fetch)
        self._peer = peer_pull(self.router, self.kv_info.block_size, cc.peer_fetch_min_tokens,
                               min(1.0, cc.kv_load_timeout_s)) if cc.peer_fetch else None
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> the engine that owns it now
        self.dead = DeadFlag()  # the frontend's record (AsyncLLM shares it)
        self.migrations = MigrationLog(len(self.fleet))
        self.mover = Mover(self._lock, self._emit, self._place, self.migrations, carry_kv(
            self.kv_info.block_size, min(cc.kv_lease_s, cc.kv_load_timeout_s)) if shared_kv else None)
        self.paces = PacedDrains(self.mover.book, self._live.get, self.mover.in_flight, self._move_paced)
        self._idle: dict[int, threading.Event] = {}  # drained engine -> set once it holds nothing
        p = config.parallel
        self.pd = PDFlow(self, PDSettings(p.prefill_engines, self.kv_info.block_size, cc.kv_lease_s,
                                          cc.kv_load_timeout_s)) if p.prefill_engines else None
        for i, c in enumerate(self.fleet.clients):
            c.hand_over_losses(self._on_lost(i), self._on_back(i))
        self.scaler = FleetScaler(self)

    # ---- the CoreClient face ----------------------------------------------------

    @property
    def admin(self) -> FleetAdmin:
        return self

    @property
    def clients(self) -> list[CoreClient]:
        return self.fleet.clients

    @property
    def states(self) -> list[EngineState]:
        return self.fleet.states

    def start(self, on_outputs: OutputHandler) -> None:
        self._on_outputs = on_outputs
        for i, c in enumerate(self.fleet.clients):
            c.start(self._sink(i, on_outputs))

    def _emit(self, outs: EngineCoreOutputs) -> None:
        assert self._on_outputs is not None  # moves start once requests flow, after start()
        self._on_outputs(outs)

    def _sink(self, i: int, on_outputs: OutputHandler) -> OutputHandler:
        def handle(outs: EngineCoreOutputs) -> None:
            snapshot = False
            with self._lock:
                if self.fleet.state(i).gone:
                    return  # all it had moved; a late message must not be delivered
                if outs.engine_error is not None:
                    if self._lose(i, f"engine {i}: {outs.engine_error}", dead=True):
                        return  # its requests went on elsewhere: no stream sees the error
                    outs.engine_error = f"engine {i}: {outs.engine_error}"
                    self.dead.set(outs.engine_error)
                    on_outputs(outs)
                    return
                snapshot = self._feed_router(i, outs)
                self._deliver(i, outs, on_outputs)
            if snapshot:
                log.warning("engine %d: a gap in its prefix-cache events; asking for a snapshot", i)
                self.fleet.client(i).request_kv_snapshot()
        return handle

    def _feed_router(self, i: int, outs: EngineCoreOutputs) -> bool:
        """Index events and prefix stats of engine i; True: ask it for a snapshot."""
        if outs.scheduler_stats is not None:
            st, slot = outs.scheduler_stats, self.fleet.slots[i]
            slot.stats = st
            slot.prefix_queries += st.prefix_cache_stats.queries
            slot.prefix_hits += st.prefix_cache_stats.hits
            idle = self._idle.get(i)
            if idle is not None and st.num_running_reqs + st.num_waiting_reqs == 0:
                idle.set()
        # An engine out of the router's view keeps no index entries.
        return (outs.kv_events is not None and self.fleet.state(i) is UP
                and not self.router.on_events(i, outs.kv_events))

    def _deliver(self, i: int, outs: EngineCoreOutputs, on_outputs: OutputHandler) -> None:
        """Only the outputs of requests engine i still owns go on (a moved
        request's late outputs from its old engine are dropped); the book
        counts them before the frontend sees them."""
        live = self._live
        if outs.outputs and self.pd is not None:
            self.pd.intercept(i, outs)  # prefill legs' outputs stop here
        if outs.outputs:
            outs.outputs = [o for o in outs.outputs if live.get(o.request_id) == i]
            now = time.monotonic()
            self.migrations.observe(i, outs.outputs, now)
            self.mover.book.absorb(outs, now)
            for o in outs.outputs:
                if o.finished:
                    del live[o.request_id]
                    self.router.finish(o.request_id)
            if self.paces:  # a paced drain's next wave moves once this one produced
                self.paces.on_outputs(outs.outputs, lambda e: self.fleet.state(e) is DRAINED)
        on_outputs(outs)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self.mover.book.add(request, time.monotonic())
            try:
                if self.pd is not None and self.pd.add(request, self._hashes(request)):
                    return  # its prefill leg runs; decode follows
                self._place(request)
            except BaseException:
                self.mover.book.drop([request.request_id])
                raise

    def _place(self, request: EngineCoreRequest) -> int:
        """Route the request (prompt + the tokens it already has) and send it;
        an engine found dead on the way is lost and the next one is tried.
        Sending under the lock: a drain or loss that moves it can never be
        overtaken by this add (it would run twice)."""
        toks, lr = request.prompt_token_ids + request.output_token_ids, request.lora_request
        hashes = self._hashes(request)
        max_tokens = resolved_max_tokens(request.sampling_params, len(request.prompt_token_ids),
                                         self.config.max_model_len) - len(request.output_token_ids)
        only = self.pd.decoders() if self.pd is not None else None  # P/D: requests decode there
        while True:
            if not self.fleet.any_up() or (only is not None and not set(only) & set(self.fleet.up())):
                raise EngineDeadError("no engine is up to take the request")
            d = self.router.route(request.request_id, hashes, len(toks), max(max_tokens, 0), request.session,
                                  lr.lora_name if lr is not None else None, only=only)
            self._live[request.request_id] = d.engine
            if self._peer is not None:  # another engine holds more of it: load that from the folder
                request = self._peer(request, hashes, d)
            try:
                self.fleet.client(d.engine).add_request(request)
                return d.engine
            except EngineDeadError as e:
                self._live.pop(request.request_id, None)
                self.router.finish(request.request_id)
                self._lose(d.engine, f"engine {d.engine}: {e}", dead=True)

    def _hashes(self, request: EngineCoreRequest) -> list[bytes]:
        """The block hashes the engines will compute for its tokens (when the router reads them)."""
        if not self._hash:
            return []
        lr = request.lora_request
        return block_hashes_of(request.prompt_token_ids + request.output_token_ids, self.kv_info.block_size,
                               request.cache_salt, lr.lora_int_id if lr is not None else None, request.mm_features)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            if self.pd is not None:
                self.pd.abort(request_ids)
            self.mover.end(request_ids)
            for rid in request_ids:
                e = self._live.pop(rid, None)
                self.migrations.end(rid)
                if e is not None:
                    by_engine.setdefault(e, []).append(rid)
                    self.router.finish(rid)
            for e, ids in by_engine.items():
                if not self.fleet.state(e).gone:
                    self.fleet.client(e).abort_requests(ids)

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        """The frontend's answer to a move's ResumeCall (conveyor/engine/dp/mover.py)."""
        self.mover.complete(tag, requests)

    def request_kv_snapshot(self) -> None:
        for i in self.fleet.up():
            self.fleet.client(i).request_kv_snapshot()

    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None:
        pass  # its engines' losses are its own business

    def engine_pid(self) -> int | None:
        return None

    # ---- moving requests between engines ------------------------------------------

    def _lose(self, i: int, why: str, dead: bool) -> bool:
        """Engine i is lost (dead, or its actor is being rebuilt): it leaves
        the router's view and its requests move to the others now. False when
        no other engine is up (then the error ends the streams as before)."""
        if self.fleet.state(i).gone:
            return True
        was_up = self.fleet.state(i) is UP
        self.fleet.set_state(i, DEAD if dead else LOST)
        if was_up:
            self.router.engine_down(i)
        idle = self._idle.pop(i, None)
        if idle is not None:  # a drain waiting on it: a lost engine holds nothing
            idle.set()
        if not self.fleet.any_up():
            return False
        self.paces.stop(i)  # its queued requests move with the rest now
        log.warning("%s; moving its %d requests to the other engines", why,
                    sum(1 for e in self._live.values() if e == i))
        self._move_off(i, "lost")
        if self.pd is not None:  # its prefill legs: decode recomputes those prompts
            self.pd.engine_lost(i)
        return True

    def _move_off(self, i: int, cause: MoveCause, ids: list[str] | None = None) -> int:
        """Take every request engine i owns (or those of `ids`) off it now and
        ask the frontend for them: its answer resubmits each, with the tokens
        it delivered (never as prompt), to the engine the router picks. A
        drained engine is told to drop them; a lost one has nothing left to drop."""
        if ids is None:
            ids = [rid for rid, e in self._live.items() if e == i]
        if not ids:
            return 0
        for rid in ids:
            del self._live[rid]
            self.router.finish(rid)
        if cause == "drain":
            self.fleet.client(i).abort_requests(ids)
        self.mover.move(i, ids, cause)
        return len(ids)

    def _move_paced(self, i: int, ids: list[str]) -> None:
        self._move_off(i, "drain", ids)

    def _resume_waiting(self) -> None:
        """An engine is up (again): requests that waited for one, on a lost
        engine or answered while none was up, go on now."""
        for j, st in enumerate(self.fleet.states):
            if st is LOST:
                self._move_off(j, "lost")
        self.mover.unpark()

    def _on_lost(self, i: int) -> Callable[[str], None]:
        def lost(cause: str) -> None:  # the engine's actor is gone; its client rebuilds it
            with self._lock:
                if not self._lose(i, f"engine {i}: {cause}", dead=False):
                    log.error("engine %d lost with no other engine up; its requests wait for "
                              "its rebuild", i)
        return lost

    def _on_back(self, i: int) -> Callable[[], None]:
        def back() -> None:  # rebuilt: it takes requests again
            with self._lock:
                if self.fleet.state(i) is not LOST:
                    return
                self.fleet.set_state(i, UP)
                self.router.engine_up(i)
                # Its own requests (the new actor holds none) go on too.
                self._move_off(i, "lost")
                self._resume_waiting()
        return back

    # ---- FleetAdmin ----------------------------------------------------------------

    def drain(self, engine: int, timeout_s: float = 60.0) -> int:
        """Route nothing more to `engine`, hand its requests to the others
        (aborted there, resubmitted with their delivered tokens; in waves with
        parallel.paced_drain, else at once) and return, once the engine holds
        none and every move is made, how many moved (a request that finished
        on it before its move does not). It stays idle until undrain(engine)."""
        with self._lock:
            self.fleet.check_index(engine)
            state = self.fleet.state(engine)
            if state is DRAINED and engine not in self._idle:
                return 0  # drained before and empty since
            if state is not UP:
                raise ValueError(f"engine {engine} is {state.value}, not up")
            if not self.fleet.any_up(besides=engine):
                raise ValueError(f"engine {engine} is the only one up: no engine to take its requests")
            self.fleet.set_state(engine, DRAINED)
            self.router.engine_down(engine)
            counted = self.migrations.moved.get((engine, "drain"), 0)
            idle = self._idle[engine] = threading.Event()
            ids = [rid for rid, e in self._live.items() if e == engine]
            held = (self.paces.start(engine, ids) if self.config.parallel.paced_drain
                    else self._move_off(engine, "drain", ids))
            if not held:
                idle.set()
        log.info("draining engine %d: %d requests to hand over", engine, held)
        deadline = time.monotonic() + timeout_s
        if not idle.wait(timeout_s):
            raise TimeoutError(f"engine {engine} still holds requests after {timeout_s:g}s")
        with self._lock:
            self._idle.pop(engine, None)
            # The last moves' answers may still be on their way from the frontend.
            if not self.mover.wait_answers(engine, deadline - time.monotonic()):
                raise TimeoutError(f"the frontend did not resume engine {engine}'s requests "
                                   f"within {timeout_s:g}s")
            return self.migrations.moved.get((engine, "drain"), 0) - counted

    def undrain(self, engine: int) -> None:
        """A drained engine takes requests again (its cache re-indexed from a snapshot)."""
        with self._lock:
            if not 0 <= engine < len(self.fleet) or self.fleet.state(engine) is not DRAINED:
                raise ValueError(f"engine {engine} is not drained")
            self.fleet.set_state(engine, UP)
            self.router.engine_up(engine)
            self.paces.stop(engine)  # what it still holds stays there
        if self._hash:
            self.fleet.client(engine).request_kv_snapshot()

    def replace_engine(self, engine: int, config: EngineConfig | None = None,
                       timeout_s: float = 60.0) -> int:
        """Put a new engine in slot `engine` (built from `config`: the same
        model, other engine settings, e.g. scheduler.max_num_seqs, for a
        rollout; by default the client's config). An engine still up is
        drained first (its requests move, none is lost); a drained or dead
        one is shut down. Returns how many requests moved. While the new one
        starts the others serve everything; it takes requests once it runs."""
        if config is not None and self._layout is not None:
            self._layout(config)  # refused before the old engine is drained
        with self.scaler.lock:  # one fleet change at a time
            with self._lock:
                self.fleet.check_index(engine)
                state = self.fleet.state(engine)
                if state is LOST:
                    raise ValueError(f"engine {engine} is being rebuilt; replace it once it is up or dead")
            moved = self.drain(engine, timeout_s) if state is UP else 0
            self.let_go(self.retire(engine, DEAD))
            self.install(engine, self.spawn(config if config is not None else self.config))
        log.info("engine %d replaced (%d requests moved off it first)", engine, moved)
        return moved

    def scale_to(self, engines: int, timeout_s: float = 60.0) -> int:
        return self.scaler.scale_to(engines, timeout_s)

    def reload(self, config: EngineConfig | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.scaler.reload(config, timeout_s)

    def add_engine(self, config: EngineConfig | None = None) -> int:
        return self.scaler.add_engine(config)

    def remove_engine(self, engine: int | None = None, timeout_s: float = 60.0) -> int:
        return self.scaler.remove_engine(engine, timeout_s)

    def rollout(self, config: EngineConfig, timeout_s: float = 60.0) -> int:
        return self.scaler.rollout(config, timeout_s)

    def engine_count(self) -> int:
        """Engines in service or coming back (up or lost)."""
        return self.fleet.in_service()

    def engines(self) -> list[dict[str, Any]]:
        """Each engine's slot, state, role and process ids (admin view; tests pick a victim here)."""
        with self._lock:
            legs = self.pd.legs.per_engine() if self.pd else None
        return engine_rows(self.fleet, self.pd.role if self.pd else None, legs.__getitem__ if legs is not None else None)

    def metric_rows(self) -> list[MetricRow]:
        """Per-engine series (conveyor/engine/dp/admin_view.py)."""
        with self._lock:
            return fleet_metric_rows(self.fleet, self.router, self.migrations)

    # ---- slots (the FleetScaler's mechanism) ------------------------------------------

    def new_slot(self) -> int:
        """One more slot, empty until installed (under the lock)."""
        with self._lock:
            free = self.fleet.free_slots()
            if free:
                return free[0]
            slot = self.router.add_engine()
            self.fleet.put(slot, Vacant(self.kv_info))
            self.fleet.set_state(slot, OFF)
            self.migrations.num_engines = slot + 1
            return slot

    def install(self, slot: int, new: CoreClient) -> None:
        """Put a started client in `slot` and route to it; requests that
        waited for an engine (every one was lost) go on now."""
        with self._lock:
            self.fleet.put(slot, new)
            new.hand_over_losses(self._on_lost(slot), self._on_back(slot))
            if self._on_outputs is not None:
                new.start(self._sink(slot, self._on_outputs))
            self.fleet.set_state(slot, UP)
            self.router.engine_up(slot)
            self._resume_waiting()

    def retire(self, slot: int, state: EngineState) -> CoreClient:
        """Take slot's client out (DEAD: to be refilled; OFF: emptied); its
        late outputs are dropped from here on. Returns it, to let_go."""
        with self._lock:
            old = self.fleet.client(slot)
            self.fleet.set_state(slot, state)
            if state is OFF:
                self.fleet.slots[slot].client = Vacant(self.kv_info)
            return old

    def let_go(self, old: CoreClient) -> None:
        """Shut a replaced or removed client down; if it started Ray, an up
        engine's client takes that over first (Ray goes down with the last)."""
        if old.started_ray:
            heir = next((self.fleet.client(i) for i in self.fleet.up()), None)
            if heir is not None:
                old.started_ray, heir.started_ray = False, True
        old.shutdown()

    def held_per_engine(self) -> dict[int, int]:
        """Requests each up engine owns now."""
        with self._lock:
            held = dict.fromkeys(self.fleet.up(), 0)
            for e in self._live.values():
                if e in held:
                    held[e] += 1
            return held

    def check_health(self) -> str:
        """"ok" when every engine still in service is; "recovering" when one
        is (or is being rebuilt); raises when none is up. A dead engine whose
        requests moved elsewhere does not fail the others' health."""
        states: list[str] = []
        for i, slot in enumerate(list(self.fleet.slots)):
            if slot.state.gone:
                continue
            if slot.state is LOST:
                states.append("recovering")
                continue
            try:
                states.append(slot.client.check_health())
            except EngineDeadError:
                if not self.fleet.any_up(besides=i):
                    raise
        if not states:
            raise EngineDeadError("every engine is dead")
        return "recovering" if "recovering" in states else "ok"

    def worker_pids(self) -> list[int]:
        return [pid for s in self.fleet.slots if not s.state.gone for pid in s.client.worker_pids()]

    def shutdown(self) -> None:
        self.scaler.stop()
        if self.pd is not None:
            self.pd.stop()
        owner = self.fleet.ray_owner()
        # Last first, and the client that started Ray after all.
        order = [i for i in reversed(range(len(self.fleet))) if i != owner] + ([owner] if owner is not None else [])
        for i in order:
            self.fleet.client(i).shutdown()
