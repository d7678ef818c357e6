"""One EngineCoreActor and the frontend's end of its data plane.

A CoreLink is started from a CoreActorSpec (what to build and where, fixed
when the client is made, so a replacement lands in the same placement group)
and owns: the actor, fresh CURVE keys for its plane (generated here, handed to
the actor through Ray; a replacement never reuses the dead one's), the two
channels and the sender thread. It reports the actor's loss (lost()) but does
not decide what to do about it: the RayCoreClient does.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from conveyor.cluster.engine_actor.actor import (
    TO_CORE,
    TO_FRONTEND,
    CoreActorPlacement,
    CoreInput,
    EngineCoreActor,
)
from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, KVCacheInfo
from conveyor.engine.errors import UnsendableRequestError
from conveyor.executors.channel import Channel, DataPlane, PlaneKeys

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = float(os.environ.get("CONVEYOR_STARTUP_TIMEOUT_S", "600"))
HEALTH_S = 10.0


class InputSender:
    """Sends CoreInputs to the actor from a thread of its own, in the order
    they were put: put() never blocks, so the HTTP event loop never waits on a
    slow or dead engine actor. The thread owns the socket (ZMQ sockets are not
    thread-safe). Once the engine is dead (`dead()` says why), what is left is
    dropped: nothing runs there any more."""

    RETRY_S = 0.001

    def __init__(self, channel: Channel, dead: Callable[[], str | None]) -> None:
        self._ch, self._dead = channel, dead
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._encode_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="core-inputs-send")
        self._thread.start()

    def put(self, msg: CoreInput) -> None:
        """Encodes here, in the caller: a message that cannot be encoded (a
        check the edge missed) raises UnsendableRequestError to its own
        caller, and the thread, which every later request needs, never sees it."""
        with self._encode_lock:
            try:
                payload = self._ch.encode(msg)
            except (TypeError, ValueError, OverflowError, UnicodeError) as e:
                raise UnsendableRequestError(
                    f"the request could not be sent to the engine: {type(e).__name__}: {e}") from None
        self._queue.put(payload)

    def alive(self) -> bool:
        """False once the thread ended while not asked to stop (a bug): /health then fails."""
        return self._thread.is_alive() or self._stop.is_set()

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            # False: no peer can take it yet (connecting) or its queue is full.
            while not self._ch.try_send_payload(payload):
                if self._stop.is_set() or self._dead() is not None:
                    break
                self._stop.wait(self.RETRY_S)

    def close(self) -> None:
        """Stop (dropping what was not sent); the channel may be closed after."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)


@dataclass(frozen=True)
class CoreActorSpec:
    """How every EngineCoreActor of one client is made: the config and the
    Ray options (resources, and the placement group the client was made in)."""
    config: EngineConfig
    options: dict[str, Any] = field(default_factory=dict)
    engine_cpus: tuple[int, ...] = ()  # the actor's step thread's cores (): unpinned

    @classmethod
    def here(cls, config: EngineConfig, placement: CoreActorPlacement | None) -> CoreActorSpec:
        """Captured in the caller's context: a Serve replica's placement group
        is the current one only there, and every replacement goes into it."""
        place = placement or CoreActorPlacement()
        opts: dict[str, Any] = {"num_cpus": place.num_cpus, "num_gpus": place.num_gpus}
        pg = ray.util.get_current_placement_group()
        if pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=place.bundle_index)
        return cls(config, opts, place.engine_cpus)


class CoreLink:
    def __init__(self, actor: Any, plane: DataPlane | None, inp: Channel, out: Channel,
                 kv_info: KVCacheInfo, keys: PlaneKeys | None = None) -> None:
        self.actor, self.plane, self.inp, self.out, self.kv_info = actor, plane, inp, out, kv_info
        self.keys = keys  # the client's half (no server secret)
        self.dead: str | None = None  # set when the actor is known gone: the sender stops
        # The workers' placement group the actor's executor made (refreshed by
        # refresh_owned_pg): Ray keeps it past the actor's death, so close() removes it.
        self.owned_pg: str | None = None
        self.status = "ok"  # the actor's last health answer: "ok" | "recovering"
        self._closed = False
        self.sender = InputSender(inp, lambda: self.dead)
        # Pending for the actor's life: it resolves (with an error) when the actor dies.
        self._watch = actor.wait_closed.remote() if actor is not None else None

    @classmethod
    def start(cls, spec: CoreActorSpec) -> CoreLink:
        keys = PlaneKeys.generate()
        actor = EngineCoreActor.options(**spec.options).remote(msgspec.msgpack.encode(spec.config),
                                                              msgspec.msgpack.encode(keys),
                                                              spec.engine_cpus)
        try:
            in_addr, out_addr, kv = ray.get(actor.addresses.remote(), timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            ray.kill(actor, no_restart=True)  # never leave a half-started actor behind
            raise
        client_keys = keys.for_clients()  # the actor alone keeps the server secret
        plane = DataPlane(client_keys, server=False)
        inp = plane.push(plane.sealer(TO_CORE, "frontend"), connect=in_addr)
        out = plane.pull(TO_FRONTEND, EngineCoreOutputs, connect=out_addr)
        link = cls(actor, plane, inp, out, msgspec.msgpack.decode(kv, type=KVCacheInfo), client_keys)
        link.refresh_owned_pg()
        return link

    def send(self, msg: CoreInput) -> None:
        self.sender.put(msg)

    def lost(self) -> str | None:
        """Why the actor is gone (its process died or was killed), else None."""
        if self._watch is None:
            return None
        ready, _ = ray.wait([self._watch], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self._watch)
        except Exception as e:  # noqa: BLE001 - any failure of the call: the actor is gone
            return f"engine actor died: {type(e).__name__}: {_first_line(e)}"
        return "engine actor shut down"

    def health_error(self, timeout_s: float) -> tuple[str, bool] | None:
        """None if the actor answers a health check in time, else (why, lost):
        lost is True when the actor itself is gone or wedged (a replacement
        can take over), False when its engine reported itself dead."""
        try:
            self.status = ray.get(self.actor.check_health.remote(), timeout=timeout_s) or "ok"
            return None
        except ray.exceptions.GetTimeoutError:
            return f"engine actor did not answer a health check within {timeout_s:g}s (wedged)", True
        except ray.exceptions.RayActorError as e:
            return f"engine actor died: {type(e).__name__}: {_first_line(e)}", True
        except Exception as e:  # noqa: BLE001 - the engine inside raised
            return f"engine actor failed: {type(e).__name__}: {_first_line(e)}", False

    def refresh_owned_pg(self) -> None:
        """Learn the executor's current placement group (it changes when the
        engine rebuilds its worker group)."""
        try:
            self.owned_pg = ray.get(self.actor.owned_placement_group_id.remote(), timeout=HEALTH_S)
        except Exception as e:  # noqa: BLE001 - a dead or busy actor keeps the last known one
            log.info("placement group of the engine actor not refreshed (%r); keeping the last known", e)

    def _remove_owned_pg(self) -> None:
        if self.owned_pg is None:
            return
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(self.owned_pg))))
        except Exception as e:  # noqa: BLE001 - already removed (graceful shutdown did)
            log.info("removing the dead engine's placement group: %r", e)
        self.owned_pg = None

    def close(self, graceful: bool) -> None:
        """Stop the actor (shut down first when graceful and it still lives)
        and close this end. Idempotent enough for a link that is already dead."""
        if self._closed:
            return
        self._closed = True
        self.dead = self.dead or "closed"
        if self.actor is not None:
            if graceful:
                try:
                    ray.get(self.actor.shutdown.remote(), timeout=60)
                except Exception as e:  # noqa: BLE001 - it may already be dead
                    log.info("engine actor shutdown: %r", e)
            ray.kill(self.actor, no_restart=True)
            if not graceful:
                self._remove_owned_pg()
        self.sender.close()  # before the plane closes its sockets
        if self.plane is not None:
            self.plane.close()


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else ""
