"""The engine tier of a Serve app with several ingress replicas.

With `parallel.data_parallel_size: N` and `serve.replicas: R > 1`, the N
EngineCoreActors belong to no replica: an `EnginePool` (a detached Ray actor
named after the app, the deployment and the engine config) starts them,
supervises them (a `RayCoreClient` per engine: a lost actor is rebuilt as
before) and outlives any one replica. The HTTP ingress is then its own tier:
Serve scales the R replicas, and each one attaches to every engine as a
frontend of its own (cluster/engine_actor/frontends.py: its own CURVE keys and channel
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

Drain (`/admin/drain`) acts on the replica that receives it only: the others
keep routing to that engine (left for the next issue).
"""
from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import Any

import msgspec
import ray

from cluster.engine_actor.actor import TO_CORE, TO_FRONTEND, CoreActorPlacement, CoreInput
from cluster.engine_actor.client import RayCoreClient
from cluster.engine_actor.link import STARTUP_TIMEOUT_S, CoreActorSpec, CoreLink
from engine.config import EngineConfig
from engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from engine.core_client import OutputHandler
from engine.dp_engine import DataParallelClient, make_engine_clients
from engine.errors import EngineDeadError
from executors.channel import DataPlane, PlaneKeys

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0
HANDSHAKE_POLL_MS = 200
POOL_RETRIES = 20


def uses_pool(config: EngineConfig) -> bool:
    """Several ingress replicas share the engines only under data parallel."""
    return config.parallel.data_parallel_size > 1 and config.serve.replicas > 1


def engine_placement(config: EngineConfig, use_gpu: bool) -> CoreActorPlacement:
    """Each engine's own resources (executor "ray": its workers' placement
    group; otherwise the model in the actor, with its GPUs)."""
    p = config.parallel
    if p.executor == "ray":
        return CoreActorPlacement()
    return CoreActorPlacement(num_cpus=1.0 if use_gpu else p.num_cpus_per_worker,
                              num_gpus=float(config.world_size) if use_gpu else 0.0)


@ray.remote(num_cpus=0, max_concurrency=16)
class EnginePool:
    """Owns the engines; replicas register, attach to each engine, release."""

    def __init__(self, config_bytes: bytes, use_gpu: bool) -> None:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        place = engine_placement(config, use_gpu)
        self.clients = make_engine_clients(config, lambda c: RayCoreClient.launch(c, place))
        for c in self.clients:
            # The pool is frontend 0 of each engine: it owns no request, so it
            # gets only the broadcast stats and events, and reads them to keep
            # the channel flowing and to watch the actor.
            c.start(lambda outs: None)
        self.users = 0
        self.closing = False

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
            for c in reversed(self.clients):
                c.shutdown()
        return self.users


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
    """A replica's DataParallelClient over the pool's engines."""

    can_scale = False  # the pool owns the engines (engine/dp_scale.py)

    def __init__(self, config: EngineConfig, pool: Any) -> None:
        self.pool = pool
        n = ray.get(pool.register.remote(), timeout=STARTUP_TIMEOUT_S)
        clients: list[Any] = []
        try:
            for i in range(n):
                clients.append(AttachedCoreClient(config, pool, i))
            super().__init__(config, clients)
        except BaseException:
            for c in clients:
                c.shutdown()
            self._release()
            raise

    def _release(self) -> None:
        try:
            if ray.get(self.pool.release.remote(), timeout=STARTUP_TIMEOUT_S) <= 0:
                ray.kill(self.pool)
        except Exception as e:  # noqa: BLE001 - the pool is gone already
            log.info("releasing the engine pool: %r", e)

    def shutdown(self) -> None:
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
