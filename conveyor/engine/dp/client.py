"""DataParallelClient: N independent engine cores behind one frontend.

A CoreClient (conveyor/engine/core_client.py), so the blocking LLM (through
SyncCoreEngine) and AsyncLLM (offline, Serve, batch) drive N engines exactly
as they drive one. `add_request` asks the router (conveyor/engine/dp/router/policy.py)
which engine takes the request, counts it there at once and hands it to that
engine's client; every engine's outputs go to the frontend's one handler,
after their prefix-cache events have fed the router's index (a gap asks that
engine for a snapshot) and finished requests have released their load. The
router is called from the frontend's thread and from the engines' output
threads, so it sits behind one lock.

Each engine is an in-process core (its own busy-loop thread; executor
"uniproc" becomes "mp" per engine, since one process holds one
torch.distributed world), or an EngineCoreActor (executor "ray", or any
executor in a Serve replica: `make_engine_client` decides). With
data_parallel_size 1 nothing here runs (no extra hop).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest
from conveyor.engine.dp.migration_log import MigrationLog
from conveyor.engine.dp.mover import Ask, MoveBook, ResumeAsks
from conveyor.engine.dp.paced_drain import PacedDrain, WarmHandover
from conveyor.engine.dp.router.policy import Router, RouterSettings, block_hashes_of
from conveyor.engine.dp.scaling import EngineScaling, owns_ray
from conveyor.engine.errors import DeadFlag, EngineDeadError
from conveyor.engine.frontend.prepare import resolved_max_tokens

log = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], None]
# Engine states: UP takes requests; DRAINED takes none until undrain; LOST
# takes none while its client rebuilds it (then UP); DEAD is gone for good.
UP, DRAINED, LOST, DEAD = "up", "drained", "lost", "dead"


def engine_config(config: EngineConfig) -> EngineConfig:
    """The config each in-process replica runs: uniproc workers go to a
    process of their own; on CPU every engine's workers share this machine's
    cores (unless parallel.cpu_threads_per_worker says otherwise)."""
    from conveyor.engine.core_client import core_in_actor

    p = config.parallel
    if p.executor not in ("uniproc", "mp") or core_in_actor(config):
        return config
    threads = p.cpu_threads_per_worker or max(1, (os.cpu_count() or 1) // (
        config.world_size * p.data_parallel_size))
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(
        p, executor="mp", cpu_threads_per_worker=threads))


def make_engine_clients(config: EngineConfig,
                        make_one: Callable[[EngineConfig], Any] | None = None) -> list[Any]:
    if make_one is None:
        from conveyor.engine.core_client import make_single_core_client

        make_one, config = make_single_core_client, engine_config(config)
    clients: list[Any] = []
    try:
        for _ in range(config.parallel.data_parallel_size):
            clients.append(make_one(config))
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
    return clients


class DataParallelClient(ResumeAsks, WarmHandover, PacedDrain, EngineScaling):
    takes_session = True  # add_request(request, session=...) (AsyncLLM checks)

    def __init__(self, config: EngineConfig, clients: list[Any] | None = None,
                 spawn: Callable[[EngineConfig], Any] | None = None) -> None:
        """spawn(config) makes one engine's client (replace_engine uses it);
        by default an in-process core, or the executor's remote client."""
        self.config = config
        if spawn is None:
            from conveyor.engine.core_client import make_single_core_client

            spawn = lambda c: make_single_core_client(engine_config(c))  # noqa: E731
        self._spawn = spawn
        self.clients = clients if clients is not None else make_engine_clients(config, spawn)
        self._on_outputs: OutputHandler | None = None
        self.kv_info = self.clients[0].kv_info
        self.router = Router(RouterSettings(policy=config.serve.router, block_size=self.kv_info.block_size,
                                            seed=config.model.seed), len(self.clients))
        self._hash = config.cache.enable_prefix_caching and config.serve.router in ("kv_aware", "session")
        # One lock over routing, the book, engine states and delivery: an
        # output is checked against its request's owner, recorded and handed
        # on in one piece, so a move never interleaves with a delivery.
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # request id -> the engine that owns it now
        # Context sizes and delivery times; the tokens are the frontend's (conveyor/engine/dp/mover.py).
        self.book = MoveBook()
        self._init_asks()
        self.dead = DeadFlag()  # the frontend's record (AsyncLLM shares it)
        self.migrations = MigrationLog(len(self.clients))
        self._warming = {}  # warm-up request id -> its request's move (conveyor/engine/dp/paced_drain.py)
        self._warm_queue = {}
        self._paces = {}  # drained engine -> its paced handover (conveyor/engine/dp/paced_drain.py)
        self.states = [UP] * len(self.clients)
        self._idle: dict[int, threading.Event] = {}  # drained engine -> set once it holds nothing
        self._prefix = [[0, 0] for _ in self.clients]  # per engine: queried, hit tokens
        self._stats: list[Any] = [None] * len(self.clients)  # per engine: its last SchedulerStats
        for i, c in enumerate(self.clients):
            self._hook(i, c)
        self._init_scaling()  # add/remove engines, rollout, autoscaler (conveyor/engine/dp/scaling.py)

    def _hook(self, i: int, c: Any) -> None:
        if hasattr(c, "hand_over_losses"):  # a RayCoreClient: its requests move instead of waiting
            c.hand_over_losses(self._on_lost(i), self._on_back(i))

    def start(self, on_outputs: OutputHandler) -> None:
        self._on_outputs = on_outputs
        for i, c in enumerate(self.clients):
            c.start(self._sink(i, on_outputs))

    def _sink(self, i: int, on_outputs: OutputHandler) -> OutputHandler:
        def handle(outs: EngineCoreOutputs) -> None:
            snapshot = False
            with self._lock:
                if self.states[i] == DEAD:
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
                self.clients[i].request_kv_snapshot()
        return handle

    def _feed_router(self, i: int, outs: EngineCoreOutputs) -> bool:
        """Index events and prefix stats of engine i; True: ask it for a snapshot."""
        if outs.scheduler_stats is not None:
            st, acc = outs.scheduler_stats, self._prefix[i]
            self._stats[i] = st
            acc[0] += st.prefix_cache_stats.queries
            acc[1] += st.prefix_cache_stats.hits
            idle = self._idle.get(i)
            if idle is not None and st.num_running_reqs + st.num_waiting_reqs == 0:
                idle.set()
        # An engine out of the router's view keeps no index entries.
        return (outs.kv_events is not None and self.states[i] == UP
                and not self.router.on_events(i, outs.kv_events))

    def _deliver(self, i: int, outs: EngineCoreOutputs, on_outputs: OutputHandler) -> None:
        """Only the outputs of requests engine i still owns go on (a moved
        request's late outputs from its old engine are dropped); the book
        counts them before the frontend sees them."""
        live = self._live
        if outs.outputs:
            outs.outputs = [o for o in self._warm_outputs(i, outs.outputs) if live.get(o.request_id) == i]
            now = time.monotonic()
            self.migrations.observe(i, outs.outputs, now)
            self.book.absorb(outs, now)
            for o in outs.outputs:
                if o.finished:
                    del live[o.request_id]
                    self.router.finish(o.request_id)
                    log.debug("request %s on engine %d: actual cached tokens %d",
                              o.request_id, i, o.num_cached_tokens)
            if self._paces:  # a paced drain's next wave moves once this one produced
                self._pace_outputs(outs.outputs)
        on_outputs(outs)

    def add_request(self, request: EngineCoreRequest, session: str | None = None) -> None:
        with self._lock:
            self.book.add(request, time.monotonic())
            try:
                self._place(request, session)
            except BaseException:
                self.book.drop([request.request_id])
                raise

    def _place(self, request: EngineCoreRequest, session: str | None = None,
               prefer: int | None = None) -> int:
        """Route the request (prompt + the tokens it already has) and send it;
        an engine found dead on the way is lost and the next one is tried.
        `prefer`: that engine if it is up (a warmed one). Sending under the
        lock: a drain or loss that moves it can never be overtaken by this
        add (it would run twice)."""
        toks, lr = request.prompt_token_ids + request.output_token_ids, request.lora_request
        hashes = block_hashes_of(toks, self.kv_info.block_size, request.cache_salt,
                                 lr.lora_int_id if lr is not None else None) if self._hash else []
        max_tokens = resolved_max_tokens(request.sampling_params, len(request.prompt_token_ids),
                                         self.config.max_model_len) - len(request.output_token_ids)
        while True:
            if UP not in self.states:
                raise EngineDeadError("no engine is up to take the request")
            if prefer is not None and self.states[prefer] == UP:
                # A warmed engine computed the context: its work is the decode ahead.
                d = self.router.assign(request.request_id, prefer, max(max_tokens, 0))
                prefer = None
            else:
                d = self.router.route(request.request_id, hashes, len(toks), max(max_tokens, 0), session,
                                      lr.lora_name if lr is not None else None)
            self._live[request.request_id] = d.engine
            try:
                self.clients[d.engine].add_request(request)
                return d.engine
            except EngineDeadError as e:
                self._live.pop(request.request_id, None)
                self.router.finish(request.request_id)
                self._lose(d.engine, f"engine {d.engine}: {e}", dead=True)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            self.book.drop(request_ids)
            self._end_moves(request_ids)
            for rid in request_ids:
                e = self._live.pop(rid, None)
                self.migrations.end(rid)
                if e is not None:
                    by_engine.setdefault(e, []).append(rid)
                    self.router.finish(rid)
            for e, ids in by_engine.items():
                if self.states[e] != DEAD:
                    self.clients[e].abort_requests(ids)

    # ---- migration -------------------------------------------------------------

    def _lose(self, i: int, why: str, dead: bool) -> bool:
        """Engine i is lost (dead, or its actor is being rebuilt): it leaves
        the router's view and its requests move to the others now. False when
        no other engine is up (then the error ends the streams as before)."""
        if self.states[i] == DEAD:
            return True
        was_up = self.states[i] == UP
        self.states[i] = DEAD if dead else LOST
        if was_up:
            self.router.engine_down(i)
        idle = self._idle.pop(i, None)
        if idle is not None:  # a drain waiting on it: a lost engine holds nothing
            idle.set()
        if UP not in self.states:
            return False
        self._warm_engine_lost(i)
        self._paces.pop(i, None)  # its queued requests move with the rest now
        log.warning("%s; moving its %d requests to the other engines", why,
                    sum(1 for e in self._live.values() if e == i))
        self._move_off(i, "lost")
        return True

    def _move_off(self, i: int, cause: str, ids: list[str] | None = None,
                  prefer: int | None = None) -> int:
        """Take every request engine i owns (or those of `ids`) off it now and
        ask the frontend for them: its answer resubmits each, with the tokens
        it delivered (never as prompt), to the engine the router picks
        (conveyor/engine/dp/mover.py). A drained engine is told to drop them; a lost
        one has nothing left to drop."""
        if ids is None:
            ids = [rid for rid, e in self._live.items() if e == i]
        if not ids:
            return 0
        for rid in ids:
            del self._live[rid]
            self.router.finish(rid)
        if cause == "drain":
            self.clients[i].abort_requests(ids)
        self._ask(Ask(i, cause, prefer), ids)
        return len(ids)

    def _resume_waiting(self) -> None:
        """An engine is up (again): requests that waited for one, on a lost
        engine or answered while none was up, go on now."""
        for j, st in enumerate(self.states):
            if st == LOST:
                self._move_off(j, "lost")
        self._unpark()

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
                if self.states[i] != LOST:
                    return
                self.states[i] = UP
                self.router.engine_up(i)
                # Its own requests (the new actor holds none) go on too.
                self._move_off(i, "lost")
                self._resume_waiting()
        return back

    def drain(self, engine: int, timeout_s: float = 60.0) -> int:
        """Route nothing more to `engine`, hand its requests to the others
        (aborted there, resubmitted with their delivered tokens; in waves with
        parallel.paced_drain, else at once) and return, once the engine holds
        none and every move is made, how many moved (a request that finished
        on it before its move does not). It stays idle until undrain(engine)."""
        with self._lock:
            if not 0 <= engine < len(self.clients):
                raise ValueError(f"engine must be in [0, {len(self.clients)}), got {engine}")
            if self.states[engine] == DRAINED and engine not in self._idle:
                return 0  # drained before and empty since
            if self.states[engine] != UP:
                raise ValueError(f"engine {engine} is {self.states[engine]}, not up")
            if sum(s == UP for s in self.states) < 2:
                raise ValueError(f"engine {engine} is the only one up: no engine to take its requests")
            self.states[engine] = DRAINED
            self.router.engine_down(engine)
            counted = self.migrations.moved.get((engine, "drain"), 0)
            idle = self._idle[engine] = threading.Event()
            # With prefix caching the new engines compute the contexts first (warm handover).
            par = self.config.parallel
            warm = self.config.cache.enable_prefix_caching and par.warm_drain
            held = (self._warm_off(engine) if warm else self._pace_off(engine) if par.paced_drain
                    else self._move_off(engine, "drain"))
            if not held:
                idle.set()
        log.info("draining engine %d: %d requests to hand over", engine, held)
        deadline = time.monotonic() + timeout_s
        if not idle.wait(timeout_s):
            raise TimeoutError(f"engine {engine} still holds requests after {timeout_s:g}s")
        with self._lock:
            self._idle.pop(engine, None)
            # The last moves' answers may still be on their way from the frontend.
            if not self._wait_answers(engine, deadline - time.monotonic()):
                raise TimeoutError(f"the frontend did not resume engine {engine}'s requests "
                                   f"within {timeout_s:g}s")
            return self.migrations.moved.get((engine, "drain"), 0) - counted

    def undrain(self, engine: int) -> None:
        """A drained engine takes requests again (its cache re-indexed from a snapshot)."""
        with self._lock:
            if not 0 <= engine < len(self.clients) or self.states[engine] != DRAINED:
                raise ValueError(f"engine {engine} is not drained")
            self.states[engine] = UP
            self.router.engine_up(engine)
            self._paces.pop(engine, None)  # what it still holds stays there
        if self._hash:
            self.clients[engine].request_kv_snapshot()

    def replace_engine(self, engine: int, config: EngineConfig | None = None,
                       timeout_s: float = 60.0) -> int:
        """Put a new engine in slot `engine` (built from `config`: the same
        model, other engine settings, e.g. scheduler.max_num_seqs, for a
        rollout; by default the client's config). An engine still up is
        drained first (its requests move, none is lost); a drained or dead
        one is shut down. Returns how many requests moved. While the new one
        starts the others serve everything; it takes requests once it runs."""
        with self._scale_lock:  # one scale operation at a time (conveyor/engine/dp/scaling.py)
            with self._lock:
                if not 0 <= engine < len(self.clients):
                    raise ValueError(f"engine must be in [0, {len(self.clients)}), got {engine}")
                state = self.states[engine]
                if state == LOST:
                    raise ValueError(f"engine {engine} is being rebuilt; replace it once it is up or dead")
            moved = self.drain(engine, timeout_s) if state == UP else 0
            with self._lock:
                self.states[engine] = DEAD  # late outputs of the old one are dropped from here on
                old = self.clients[engine]
            self._let_go(old)
            self._install(engine, self._spawn(config if config is not None else self.config))
        log.info("engine %d replaced (%d requests moved off it first)", engine, moved)
        return moved

    def engines(self) -> list[dict[str, Any]]:
        """Each engine's slot, state and process ids (admin view; tests pick a victim here)."""
        out: list[dict[str, Any]] = []
        for i, c in enumerate(list(self.clients)):
            st = self._stats[i]
            info: dict[str, Any] = {"engine": i, "state": self.slot_state(i), "kv_cache_usage": (
                st.kv_cache_usage if st is not None else 0.0), "requests": (
                st.num_running_reqs + st.num_waiting_reqs if st is not None else 0)}
            if self.states[i] in (UP, DRAINED):
                info["worker_pids"] = c.worker_pids()
                if hasattr(c, "engine_pid"):
                    info["actor_pid"] = c.engine_pid()
            out.append(info)
        return out

    def check_health(self) -> str:
        """"ok" when every engine still in service is; "recovering" when one
        is (or is being rebuilt); raises when none is up. A dead engine whose
        requests moved elsewhere does not fail the others' health."""
        states: list[str] = []
        for i, c in enumerate(self.clients):
            if self.states[i] == DEAD:
                continue
            if self.states[i] == LOST:
                states.append("recovering")
                continue
            try:
                states.append(c.check_health())
            except EngineDeadError:
                if not any(s == UP for j, s in enumerate(self.states) if j != i):
                    raise
        if not states:
            raise EngineDeadError("every engine is dead")
        return "recovering" if "recovering" in states else "ok"

    def worker_pids(self) -> list[int]:
        return [pid for i, c in enumerate(self.clients) if self.states[i] != DEAD for pid in c.worker_pids()]

    def metric_rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        """Per-engine series, each with an `engine` label: (name, kind, labels,
        value) for prefix-cache queries and hits in tokens, the router's
        decisions by policy and reason, its index size in blocks, migrations
        off each engine by cause, and tokens each engine prefilled again for
        requests migrated to it (conveyor/engine/dp/migration_log.py)."""
        rows: list[tuple[str, str, dict[str, str], float]] = []
        with self._lock:
            for e, (q, h) in enumerate(self._prefix):
                lab = {"engine": str(e)}
                rows += [("prefix_cache_queries", "counter", lab, q), ("prefix_cache_hits", "counter", lab, h),
                         ("router_index_blocks", "gauge", lab, self.router.index_size(e))]
            for (policy, reason, e), n in sorted(self.router.decisions.items()):
                rows.append(("router_decisions", "counter",
                             {"engine": str(e), "policy": policy, "reason": reason}, n))
            rows += self.migrations.rows()
        return rows

    def metrics(self) -> dict[str, float]:
        """metric_rows keyed by their Prometheus names (LLM.get_metrics)."""
        out: dict[str, float] = {}
        for name, kind, lab, v in self.metric_rows():
            labels = ",".join(f'{k}="{x}"' for k, x in lab.items())
            out[f"conveyor:{name}{'_total' if kind == 'counter' else ''}{{{labels}}}"] = v
        return out

    def shutdown(self) -> None:
        self._stop_scaling()
        # Last first, and the client that started Ray (engine 0 at first) after all.
        for c in sorted(reversed(self.clients), key=owns_ray):
            c.shutdown()
