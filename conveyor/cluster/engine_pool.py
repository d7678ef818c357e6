"""The engine tier of a Serve app with several ingress replicas.

With `parallel.data_parallel_size: N` and `serve.replicas: R > 1`, the N
EngineCoreActors belong to no replica: an `EnginePool` (a detached Ray actor
named after the app, the deployment and the engine config) starts them,
supervises them (a `RayCoreClient` per engine: a lost actor is rebuilt as
before) and outlives any one replica. The HTTP ingress is then its own tier:
Serve scales the R replicas, and each one attaches to every engine as a
frontend of its own (conveyor/cluster/engine_actor/frontends.py: its own CURVE keys and channel
pair per engine; outputs come back to the replica that sent the request).

Each replica keeps its own DataParallelClient, so its own router and index.
Every engine's KV events and load go to every attached frontend, so each
index also holds the blocks cached through the other replicas: eventually
consistent (a replica that attaches late sees a gap and asks for a snapshot).
In-flight counts are per replica; the engines' reported load covers the rest.

Engine loss: each replica's `AttachedCoreClient` sees its actor die (the
pending `wait_closed` call fails) and hands its requests to its other
engines at once (the data-parallel migration path); the pool rebuilds the
actor, and the client attaches to the new one (`on_back`). With R = 1 none of
this is used: the replica owns its engines as before.

Admin (`/admin/drain`, `/admin/undrain`, `/admin/replace`) acts on the pool,
whichever replica receives it: the pool keeps each engine's admin state
("up" / "drained", a version bumped on each change) and every replica follows
it (a watcher thread long-polls `EnginePool.watch`): a drained engine leaves
every replica's router and each replica moves its own requests off it; the
receiving replica's call returns once the engine holds none (its scheduler
stats count every replica's requests). A replace drains pool-wide, then the
pool starts the new actor in the slot (`EnginePool.replace`); the receiving
replica attaches to it at once, the others through the engine-loss path (the
old actor goes away, they attach to the pool's new one).
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import ray

from conveyor.cluster.engine_actor.actor import TO_CORE, TO_FRONTEND, CoreActorPlacement, CoreInput
from conveyor.cluster.engine_actor.client import RayCoreClient
from conveyor.cluster.engine_actor.link import STARTUP_TIMEOUT_S, CoreActorSpec, CoreLink
from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from conveyor.engine.core_client import CoreClient, OutputHandler
from conveyor.engine.dp.client import DataParallelClient
from conveyor.engine.dp.fleet import EngineState, Fleet, Slot
from conveyor.engine.errors import EngineDeadError
from conveyor.executors.channel import DataPlane, PlaneKeys

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0
HANDSHAKE_POLL_MS = 200
POOL_RETRIES = 20
WATCH_TIMEOUT_S = 5.0  # a watcher's long poll; it also notices a closed replica this often
UP, DRAINED = EngineState.UP, EngineState.DRAINED


# max_concurrency: each replica keeps one call waiting in watch().
@ray.remote(num_cpus=0, max_concurrency=64)
class EnginePool:
    """Owns the engines; replicas register, attach to each engine, release."""

    def __init__(self, config_bytes: bytes, use_gpu: bool) -> None:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        self._place = CoreActorPlacement.of_engine(config, use_gpu)
        self._config = config
        self.clients = Fleet.start(config, lambda c: RayCoreClient.launch(c, self._place)).clients
        for c in self.clients:
            # The pool is frontend 0 of each engine: it owns no request, so it
            # gets only the broadcast stats and events, and reads them to keep
            # the channel flowing and to watch the actor.
            c.start(lambda outs: None)
        self.users = 0
        self.closing = False
        # Admin state per engine (absent: up) and its version; watchers wait on it.
        self._admin: dict[int, EngineState] = {}
        self._version = 0
        self._changed = threading.Condition()

    def register(self) -> int:
        """One more replica; returns the number of engines."""
        if self.closing:
            raise RuntimeError("the engine pool is shutting down")
        self.users += 1
        return len(self.clients)

    def replicas(self) -> int:
        """How many replicas hold it now."""
        return self.users

    def engine(self, i: int) -> tuple[Any, str | None]:
        """Engine i's current actor and, once it cannot come back, why."""
        c = self.clients[i]
        return c.link.actor, c.dead.cause

    def release(self) -> int:
        """One replica fewer; the last one out shuts the engines down."""
        self.users -= 1
        if self.users <= 0 and not self.closing:
            self.closing = True
            self._bump()
            for c in reversed(self.clients):
                c.shutdown()
        return self.users

    # ---- admin state, shared by every replica -------------------------------------------

    def _bump(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def admin_states(self) -> list[EngineState]:
        return [self._admin.get(i, UP) for i in range(len(self.clients))]

    def set_state(self, i: int, state: EngineState) -> None:
        """Engine i drained (routed to by no replica) or up again, pool-wide.
        ValueError: out of range, or draining the last engine up."""
        if not 0 <= i < len(self.clients) or state not in (UP, DRAINED):
            raise ValueError(f"engine must be in [0, {len(self.clients)}), got {i}")
        with self._changed:
            states = self.admin_states()
            if states[i] == state:
                return
            if state == DRAINED and states.count(UP) < 2:
                raise ValueError(f"engine {i} is the only one up: no engine to take its requests")
            self._admin[i] = state
        self._bump()

    def watch(self, version: int, timeout_s: float) -> tuple[int, list[EngineState], bool]:
        """(version, admin states, closing) once the version is not `version`
        (or after timeout_s): a replica's long poll."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout_s)
            return self._version, self.admin_states(), self.closing

    def replace(self, i: int, config_bytes: bytes | None) -> None:
        """A new engine actor in slot i (of `config_bytes`' config, else the
        pool's), up for every replica. Until it runs, engine(i) still names
        the old actor (not dead), so replicas that lost it wait for this one."""
        if not 0 <= i < len(self.clients):
            raise ValueError(f"engine must be in [0, {len(self.clients)}), got {i}")
        config = (msgspec.msgpack.decode(config_bytes, type=EngineConfig)
                  if config_bytes is not None else self._config)
        self.clients[i].shutdown()
        new = RayCoreClient.launch(config, self._place)
        new.start(lambda outs: None)
        self.clients[i] = new
        with self._changed:
            self._admin.pop(i, None)
        self._bump()


class AttachedLink(CoreLink):
    """This replica's channels to an engine the pool owns: closing it
    detaches (the actor lives on for the other replicas)."""

    fid = 0

    @classmethod
    def attach(cls, actor: Any) -> AttachedLink:
        keys = PlaneKeys.generate()  # this frontend's own plane; the actor gets them through Ray
        fid, in_addr, out_addr, kv = ray.get(actor.attach.remote(msgspec.msgpack.encode(keys)),
                                             timeout=CALL_TIMEOUT_S)
        client_keys = keys.for_clients()
        plane = DataPlane(client_keys, server=False)
        inp = plane.push(plane.sealer(TO_CORE, "frontend"), connect=in_addr)
        out = plane.pull(TO_FRONTEND, EngineCoreOutputs, connect=out_addr)
        link = cls(actor, plane, inp, out, msgspec.msgpack.decode(kv, type=KVCacheInfo), client_keys)
        link.fid = fid
        try:
            link._handshake()
        except BaseException:
            link.close(graceful=True)
            raise
        return link

    def _handshake(self) -> None:
        """Both channels carry traffic before any request is sent: ask for a
        snapshot until one message arrives (the engine drops what it cannot
        send to a frontend that has not connected yet)."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            self.send(CoreInput("kv_snapshot"))
            if self.out.recv(timeout_ms=HANDSHAKE_POLL_MS) is not None:
                return
            if self.lost() is not None:
                break
        raise EngineDeadError("an engine did not answer this frontend's handshake")

    def refresh_owned_pg(self) -> None:
        pass  # the pool's client tracks (and removes) the worker group

    def close(self, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self.dead = self.dead or "closed"
        if graceful:
            try:
                ray.get(self.actor.detach.remote(self.fid), timeout=CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - gone already: nothing to detach from
                log.info("detaching from an engine actor: %r", e)
        self.sender.close()
        if self.plane is not None:
            self.plane.close()


class AttachedCoreClient(RayCoreClient):
    """RayCoreClient over an engine the pool owns: a lost actor is not
    rebuilt here (the pool does it); this client attaches to the new one."""

    def __init__(self, config: EngineConfig, pool: Any, index: int) -> None:
        self._pool, self._index = pool, index
        self._tag = f"{uuid.uuid4().hex[:12]}/"
        link = self._attach(None, STARTUP_TIMEOUT_S)
        if link is None:
            raise EngineDeadError(f"engine {index} of the pool did not come up")
        # The spec is never started from: _start_new_link attaches to the pool's new actor.
        super().__init__(CoreActorSpec(config), link)

    def _attach(self, old: Any, timeout_s: float) -> AttachedLink | None:
        """Attach to the pool's current actor for this engine, waiting for one
        that is not `old` (the pool is rebuilding it)."""
        deadline = time.monotonic() + timeout_s
        while not getattr(self, "_closing", False):
            try:
                actor, dead = ray.get(self._pool.engine.remote(self._index), timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayActorError as e:  # the pool itself is gone
                dead = f"the engine pool is gone: {type(e).__name__}"
            if dead is not None:
                log.error("engine %d is dead in the pool: %s", self._index, dead)
                return None
            if old is None or actor._actor_id != old._actor_id:
                try:
                    return AttachedLink.attach(actor)
                except Exception as e:  # noqa: BLE001 - retried until the deadline
                    log.warning("attaching to engine %d failed (%r); retrying", self._index, e)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return None

    def _start_new_link(self) -> CoreLink | None:
        return self._attach(self.link.actor, self.config.parallel.recovery_timeout_s)

    # Request ids are only unique per frontend (LLM counts from 0; an HTTP
    # client may name its own): on the wire each carries this frontend's tag,
    # so the engine and its output routing never see two frontends' ids collide.

    def start(self, on_outputs: OutputHandler) -> None:
        cut = len(self._tag)

        def untag(outs: EngineCoreOutputs) -> None:
            for o in outs.outputs:
                o.request_id = o.request_id[cut:]
            on_outputs(outs)
        super().start(untag)

    def add_request(self, request: EngineCoreRequest) -> None:
        super().add_request(msgspec.structs.replace(request, request_id=self._tag + request.request_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        super().abort_requests([self._tag + r for r in request_ids])


class PooledClient(DataParallelClient):
    """A replica's DataParallelClient over the pool's engines. Drain, undrain
    and replace act on the pool (every replica follows), see the module doc."""

    def __init__(self, config: EngineConfig, pool: Any) -> None:
        self.pool = pool
        self._leading: set[int] = set()  # engines this replica's own admin call is draining
        self._slot = -1  # the engine replace_engine is replacing (its spawn reads it)
        self._replacing = threading.Lock()
        self._watching = True
        n = ray.get(pool.register.remote(), timeout=STARTUP_TIMEOUT_S)
        clients: list[CoreClient] = []
        try:
            for i in range(n):
                clients.append(AttachedCoreClient(config, pool, i))
            super().__init__(config, spawn=self._spawn_in_pool, fleet=Fleet([Slot(c) for c in clients]))
            self.scaler.can_scale = False  # the pool owns the engines (conveyor/engine/dp/scaling.py)
        except BaseException:
            for c in clients:
                c.shutdown()
            self._release()
            raise
        threading.Thread(target=self._follow, daemon=True, name="pool-admin-watch").start()

    # ---- admin, pool-wide -------------------------------------------------------------

    def drain(self, engine: int, timeout_s: float = 60.0) -> int:
        """Drain `engine` for every replica; returns this replica's moved
        requests once the engine holds none (anyone's)."""
        if not 0 <= engine < len(self.clients):
            raise ValueError(f"engine must be in [0, {len(self.clients)}), got {engine}")
        deadline = time.monotonic() + timeout_s
        self._leading.add(engine)
        try:
            ray.get(self.pool.set_state.remote(engine, DRAINED), timeout=CALL_TIMEOUT_S)
            moved = super().drain(engine, timeout_s)
        finally:
            self._leading.discard(engine)
        # Ours are off; the other replicas move theirs as they see the pool's
        # state. The engine's stats (broadcast to every replica) count them
        # all; an empty abort makes an idle engine send fresh ones (the last
        # we hold may predate a rebuild), a busy one sends them every step.
        slot = self.fleet.slots[engine]
        stale = slot.stats
        slot.client.abort_requests([])
        while (st := slot.stats) is stale or st is None or st.num_running_reqs + st.num_waiting_reqs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {engine} still holds requests after {timeout_s:g}s")
            time.sleep(0.02)
        return moved

    def undrain(self, engine: int) -> None:
        with self._lock:
            if not 0 <= engine < len(self.fleet) or self.fleet.state(engine) is not DRAINED:
                raise ValueError(f"engine {engine} is not drained")
        self._leading.add(engine)  # this replica's watcher leaves it to this call
        try:
            ray.get(self.pool.set_state.remote(engine, UP), timeout=CALL_TIMEOUT_S)
            super().undrain(engine)
        finally:
            self._leading.discard(engine)

    def replace_engine(self, engine: int, config: EngineConfig | None = None,
                       timeout_s: float = 60.0) -> int:
        """DataParallelClient.replace_engine with the pool's engine: drained
        pool-wide first (self.drain), then the pool starts the new actor."""
        with self._replacing:
            self._slot = engine
            return super().replace_engine(engine, config, timeout_s)

    def _spawn_in_pool(self, config: EngineConfig) -> AttachedCoreClient:
        blob = None if config is self.config else msgspec.msgpack.encode(config)
        ray.get(self.pool.replace.remote(self._slot, blob), timeout=STARTUP_TIMEOUT_S)
        return AttachedCoreClient(config, self.pool, self._slot)

    def _follow(self) -> None:
        """Apply the pool's admin states here as they change (another
        replica's drain, undrain or replace)."""
        version = -1
        while self._watching:
            try:
                version, states, closing = ray.get(self.pool.watch.remote(version, WATCH_TIMEOUT_S),
                                                   timeout=WATCH_TIMEOUT_S + CALL_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the pool is gone (shut down with its last replica)
                log.info("engine pool watch ended: %r", e)
                return
            if closing:
                return
            for i, state in enumerate(states[:len(self.clients)]):
                if i in self._leading:
                    continue
                if state == DRAINED and self.states[i] == UP:
                    threading.Thread(target=self._drain_here, args=(i,), daemon=True).start()
                elif state == UP and self.states[i] == DRAINED:
                    self._quietly(DataParallelClient.undrain, i)

    def _drain_here(self, i: int) -> None:
        """Another replica drains engine i: stop routing there, move ours off."""
        self._quietly(DataParallelClient.drain, i, self.config.parallel.recovery_timeout_s)

    def _quietly(self, fn: Any, *args: Any) -> None:
        try:
            fn(self, *args)
        except (ValueError, TimeoutError) as e:  # the state moved on meanwhile
            log.info("following the pool's admin state: %s", e)

    def _release(self) -> None:
        try:
            if ray.get(self.pool.release.remote(), timeout=STARTUP_TIMEOUT_S) <= 0:
                ray.kill(self.pool)
        except Exception as e:  # noqa: BLE001 - the pool is gone already
            log.info("releasing the engine pool: %r", e)

    def shutdown(self) -> None:
        self._watching = False
        super().shutdown()
        self._release()


def pool_name(config_bytes: bytes) -> str:
    """One pool per app, deployment and engine config (a redeploy with another
    config gets a pool of its own; the old one goes with its last replica)."""
    digest = hashlib.sha256(config_bytes).hexdigest()[:12]
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"conveyor-engines:{ctx.app_name}:{ctx.deployment}:{digest}"
    except Exception:  # noqa: BLE001 - outside a replica (tests, tools)
        return f"conveyor-engines:{digest}"


def pooled_client(config: EngineConfig, use_gpu: bool) -> PooledClient:
    """This replica's client over the app's engine pool (started by the first
    replica to get here; a pool shutting down is waited out)."""
    blob = msgspec.msgpack.encode(config)
    name = pool_name(blob)
    for attempt in range(POOL_RETRIES):
        pool = EnginePool.options(name=name, get_if_exists=True, lifetime="detached",
                                  scheduling_strategy="DEFAULT").remote(blob, use_gpu)
        try:
            return PooledClient(config, pool)
        except (RuntimeError, ray.exceptions.RayActorError) as e:
            # A pool whose last replica just left: wait until its name is free.
            if attempt == POOL_RETRIES - 1 or not (isinstance(e, ray.exceptions.RayActorError)
                                                   or "shutting down" in str(e)):
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")
