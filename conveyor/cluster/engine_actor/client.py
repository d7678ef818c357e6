"""RayCoreClient: the CoreClient of an engine whose core is an EngineCoreActor,
and its supervisor.

The reader thread delivers the actor's outputs and watches the actor (a
pending call that fails when it dies, and a health check every
PING_INTERVAL_S bounded by parallel.step_timeout_s for a wedged one). When the
actor is lost it starts a new one from the same CoreActorSpec (same placement
group, fresh plane keys) within parallel.max_restarts per
parallel.restart_window_s, and asks the frontend (a ResumeCall through the
outputs, conveyor/engine/contracts.py) for every request the lost actor held: the
frontend resubmits each from its own record of the tokens it delivered, after
every output that came before the loss, so none is repeated or missed.
Requests added (or resubmitted) while no actor runs wait here and go to the
new one. Past that budget, or without a new actor within
parallel.recovery_timeout_s, the engine is dead: one engine_error message
ends every stream with "error" and health fails.
An engine that reports itself dead (its core's own fail-fast path) is not
restarted: it already spent its worker-restart budget.

Under data parallel (conveyor/engine/dp/client.py, hand_over_losses) the requests do
not wait for the rebuild: the moment the actor is lost, on_lost moves them to
the other engines, and the rebuild goes on in the background (on_back: it
takes requests again). The data-parallel client then asks the frontend.

The client of a core in an actor (parallel.engine_actor): Serve hands it in,
and conveyor/engine/core_client.py's actor_client_factory is its default for LLM/AsyncLLM.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from conveyor.cluster.engine_actor.actor import CoreActorPlacement, CoreInput
from conveyor.cluster.engine_actor.link import CoreActorSpec, CoreLink
from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo, ResumeCall
from conveyor.engine.core.recovery import RestartBudget
from conveyor.engine.core_client import FleetAdmin, OutputHandler
from conveyor.engine.errors import DeadFlag, EngineDeadError
from conveyor.executors.ray_executor import ensure_ray

log = logging.getLogger(__name__)
# A health check the actor does not answer in time fails: a wedged actor is
# not a healthy one (its executor bounds each step by parallel.step_timeout_s).
HEALTH_TIMEOUT_S = 10.0
PING_INTERVAL_S = 2.0
RECV_POLL_MS = 200


class RayCoreClient:
    """CoreClient over an EngineCoreActor (the process boundary of DESIGN §3)."""

    def __init__(self, spec: CoreActorSpec, link: CoreLink, started_ray: bool = False) -> None:
        """The client of the actor behind `link`; every replacement is started
        from `spec`. started_ray: shutdown() ends the Ray this client started."""
        self.spec, self.started_ray = spec, started_ray
        config = self.config = spec.config
        self.link = link
        self.kv_info: KVCacheInfo = link.kv_info
        p = config.parallel
        self.budget = RestartBudget(p.max_restarts, p.restart_window_s)
        self.num_restarts = 0
        self.recovering = False
        self.dead = DeadFlag()
        # Ids of the requests the current actor holds (arrival order; no tokens:
        # the frontend keeps those), and the requests that wait for a new actor.
        self._sent: dict[str, None] = {}
        self._waiting: dict[str, EngineCoreRequest] = {}
        # Guards link, _sent, _waiting and recovering: adds and aborts from
        # the event loop against the reader thread's swap to a new actor.
        self._lock = threading.Lock()
        self._closing = False
        self._reader: threading.Thread | None = None
        self._on_lost: Callable[[str], None] | None = None
        self._on_back: Callable[[], None] | None = None

    @classmethod
    def launch(cls, config: EngineConfig, placement: CoreActorPlacement | None = None) -> RayCoreClient:
        """Start an EngineCoreActor for `config` (and Ray, when none runs here)
        and return its client; the default core_client_factory."""
        started_ray = ensure_ray(config)
        spec = CoreActorSpec.here(config, placement)
        return cls(spec, CoreLink.start(spec), started_ray)

    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None:
        """Data parallel: call on_lost(cause) when the actor is lost (before
        any rebuild) and on_back() once a new one runs; ask the frontend for
        nothing (the caller moves the requests)."""
        self._on_lost, self._on_back = on_lost, on_back

    # ---- what the tests and tools look at (the current actor's) --------------------

    @property
    def actor(self):  # noqa: ANN201 - a Ray actor handle
        return self.link.actor

    @property
    def keys(self):  # noqa: ANN201 - PlaneKeys
        return self.link.keys

    @property
    def admin(self) -> FleetAdmin | None:
        return None

    def engine_pid(self) -> int:
        """The current EngineCoreActor's process id."""
        import ray

        return ray.get(self.link.actor.pid.remote(), timeout=30)

    # ---- CoreClient ----------------------------------------------------------------

    def start(self, on_outputs: OutputHandler) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_outputs,), daemon=True,
                                        name="core-outputs")
        self._reader.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Never blocks (the caller is the HTTP event loop): the sender thread
        sends; a known-dead engine raises here and now. During a restart the
        request waits here and goes to the new actor."""
        with self._lock:
            self._raise_if_dead()
            if self.recovering:
                self._waiting[request.request_id] = request
            else:
                self._sent[request.request_id] = None
                self.link.send(CoreInput("add", request))

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        """The frontend's answer to this client's ResumeCall: the lost actor's
        requests, each with the tokens it delivered, go to the new actor."""
        for r in requests:
            self.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = list(request_ids)
        with self._lock:
            self._raise_if_dead()
            for rid in ids:
                self._sent.pop(rid, None)
                self._waiting.pop(rid, None)
            if not self.recovering:
                self.link.send(CoreInput("abort", request_ids=ids))

    def request_kv_snapshot(self) -> None:
        """The router saw a gap in this engine's prefix-cache events (data
        parallel): the actor sends a full snapshot on its output channel. A new
        actor starts a new epoch by itself, so nothing is sent while recovering."""
        with self._lock:
            if self.dead.cause is None and not self.recovering:
                self.link.send(CoreInput("kv_snapshot"))

    def check_health(self) -> str:
        """"ok", or "recovering" while the actor or its worker group is being
        replaced; raises EngineDeadError when the engine cannot go on. A lost
        actor the restart budget still covers is not dead: the reader replaces it."""
        self._raise_if_dead()
        self._raise_if_thread_died()
        if self.recovering:
            return "recovering"
        err = self.link.health_error(HEALTH_TIMEOUT_S)
        if err is None:
            return self.link.status
        why, lost = err
        if lost and self.budget.available():
            return "recovering"
        raise EngineDeadError(why)

    def worker_pids(self) -> list[int]:
        import ray

        return ray.get(self.link.actor.worker_pids.remote(), timeout=30)

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._reader is not None:
            self._reader.join(timeout=10)
        with self._lock:
            link = self.link
        link.close(graceful=self.dead.cause is None)
        if self.started_ray:
            import ray

            ray.shutdown()

    def _raise_if_dead(self) -> None:
        self.dead.check()

    def _raise_if_thread_died(self) -> None:
        """A dead internal thread is a dead engine, whatever the actor says:
        without it nothing is sent or delivered, so health must fail (Serve
        then replaces the replica) rather than every request timing out."""
        reader = self._reader
        if reader is not None and not reader.is_alive() and not self._closing:
            raise EngineDeadError("the engine's output thread died")
        if not self.link.sender.alive():
            raise EngineDeadError("the engine's input-send thread died")

    # ---- the reader: outputs and supervision -----------------------------------------

    def _read(self, on_outputs: OutputHandler) -> None:
        last_ping = time.monotonic()
        while not self._closing:
            link = self.link
            outs = link.out.recv(timeout_ms=RECV_POLL_MS)
            if outs is not None:
                if outs.engine_error is not None:
                    self._fail(outs.engine_error, on_outputs)
                    return
                for o in outs.outputs:
                    if o.finished:
                        self._sent.pop(o.request_id, None)
                on_outputs(outs)
            ping_due = time.monotonic() - last_ping > PING_INTERVAL_S
            if outs is not None and not ping_due:
                continue
            cause, lost = self._check(link, ping_due)
            if ping_due:
                last_ping = time.monotonic()
            if cause is None or self._closing:
                continue
            if lost and self._on_lost is not None:
                self._on_lost(cause)  # its requests go on elsewhere now
            if not (lost and self._replace(link, cause, on_outputs)):
                self._fail(cause, on_outputs)
                return
            if self._on_back is not None:
                self._on_back()
            last_ping = time.monotonic()

    def _check(self, link: CoreLink, ping: bool) -> tuple[str | None, bool]:
        """(why the actor cannot go on, whether a replacement may): its death
        shows at once (the pending call fails); a wedge only on a ping."""
        cause = link.lost()
        if cause is not None or not ping:
            return cause, True
        err = link.health_error(self.config.parallel.step_timeout_s)
        if err is not None:
            return err
        link.refresh_owned_pg()
        return None, True

    def _replace(self, old: CoreLink, cause: str, on_outputs: OutputHandler) -> bool:
        """Ask the frontend for what was in flight and start a new actor, which
        gets it (and whatever was added meanwhile) once it runs; False past
        the restart budget or when no actor starts within recovery_timeout_s."""
        if not self.budget.take():
            log.error("engine actor lost (%s); past parallel.max_restarts=%d per %gs: failing",
                      cause, self.config.parallel.max_restarts, self.config.parallel.restart_window_s)
            return False
        t0 = time.monotonic()
        with self._lock:
            self.recovering = True
            lost, self._sent = list(self._sent), {}
        log.warning("engine actor lost (%s); starting a new one (restart %d, %d requests in flight)",
                    cause, self.num_restarts + 1, len(lost))
        if lost and self._on_lost is None:  # under data parallel they moved already
            on_outputs(EngineCoreOutputs(resume=ResumeCall(self.num_restarts, lost)))
        old.dead = cause
        old.close(graceful=False)
        link = self._start_new_link()
        if link is None:
            return False
        with self._lock:
            self.link, self.kv_info = link, link.kv_info
            for request in self._waiting.values():  # in the order they came
                link.send(CoreInput("add", request))
            self._sent, self._waiting = dict.fromkeys(self._waiting), {}
            self.recovering = False
        self.num_restarts += 1
        log.warning("engine actor replaced in %.1fs", time.monotonic() - t0)
        return True

    def _start_new_link(self) -> CoreLink | None:
        timeout_s = self.config.parallel.recovery_timeout_s
        deadline = time.monotonic() + timeout_s
        while not self._closing:
            try:
                link = CoreLink.start(self.spec)
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                if time.monotonic() > deadline:
                    log.error("no new engine actor within parallel.recovery_timeout_s=%gs: %r",
                              timeout_s, e)
                    return None
                log.warning("starting a new engine actor failed (%r); retrying", e)
                time.sleep(1.0)
                continue
            if self._closing:  # shut down meanwhile: this one is not wanted
                link.close(graceful=True)
                return None
            return link
        return None

    def _fail(self, message: str, on_outputs: OutputHandler) -> None:
        if self._closing:
            return
        with self._lock:
            self.dead.set(message)
            self.link.dead = message  # its sender drops what is left
            self.recovering = False
            self._sent.clear()
            self._waiting.clear()
        on_outputs(EngineCoreOutputs(engine_error=message))

