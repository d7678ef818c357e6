"""EngineCoreActor: EngineCore in a Ray actor, spoken to over CURVE-encrypted ZMQ.

Input channel (frontend PUSH -> actor PULL): ADD / ABORT / UTILITY messages.
Output channel (actor PUSH -> frontend PULL): one EngineCoreOutputs per step.
The actor binds both (it is the CURVE server and admits only the frontend's
key); the frontend generates the plane's keys and hands them to the actor
through Ray (executors/channel.py). Frames carry route, sender and sequence
number under a MAC; a bad frame is dropped and counted, never fatal. The
actor's workers are Ray actors of their own (RayExecutor, with a data plane of
its own), in the caller's placement group when there is one.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import ray

from engine.config import EngineConfig
from engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from engine.core_client import EngineBusyLoop, OutputHandler
from engine.errors import EngineDeadError
from executors.channel import Channel, DataPlane, PlaneKeys
from executors.frames import Route
from executors.ray_executor import cluster_host, ensure_ray

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = float(os.environ.get("CONVEYOR_STARTUP_TIMEOUT_S", "600"))
# A health check the actor does not answer in time fails: a wedged actor is
# not a healthy one (its executor bounds each step by parallel.step_timeout_s).
HEALTH_TIMEOUT_S = 10.0


class CoreInput(msgspec.Struct, array_like=True, gc=False):
    kind: str  # "add" | "abort" | "utility"
    request: EngineCoreRequest | None = None
    request_ids: list[str] = msgspec.field(default_factory=list)
    method: str | None = None


TO_CORE = Route("frontend->core", "CoreInput")
TO_FRONTEND = Route("core->frontend", "EngineCoreOutputs")


@ray.remote(num_cpus=0, max_concurrency=4)
class EngineCoreActor:
    def __init__(self, config_bytes: bytes, keys_bytes: bytes) -> None:
        from engine.core import EngineCore
        from executors import make_executor

        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        self.core = EngineCore(config, make_executor(config))
        host = cluster_host()
        self._plane = DataPlane(msgspec.msgpack.decode(keys_bytes, type=PlaneKeys), server=True)
        self._in = self._plane.pull(TO_CORE, CoreInput, bind_host=host)
        self._out = self._plane.push(self._plane.sealer(TO_FRONTEND, "core"), bind_host=host)
        self._loop = EngineBusyLoop(self.core, self._out.send)
        self._closing = False
        self._reader = threading.Thread(target=self._read_inputs, daemon=True, name="core-inputs")
        self._reader.start()
        self._runner = threading.Thread(target=self._loop.run, daemon=True, name="core-loop")
        self._runner.start()

    def addresses(self) -> tuple[str, str, bytes]:
        return self._in.address, self._out.address, msgspec.msgpack.encode(self.core.kv_info)

    def _read_inputs(self) -> None:
        # recv() drops bad frames itself; this thread must outlive any input.
        while not self._closing:
            msg = self._in.recv(timeout_ms=200)
            if msg is None:
                continue
            if msg.kind == "add" and msg.request is not None:
                self._loop.submit("add", msg.request)
            elif msg.kind == "abort":
                self._loop.submit("abort", msg.request_ids)
            else:
                log.warning("ignored a core input of kind %r", msg.kind)

    def listen_addresses(self) -> list[str]:
        """Every ZMQ endpoint this actor's process binds: its input and output
        sockets, then its executor's (when it has a data plane)."""
        own = [self._in.address, self._out.address]
        return own + list(getattr(self.core.executor, "listen_addresses", list)())

    def data_plane_stats(self) -> dict[str, int]:
        """Dropped frames and refused handshakes, this actor's and its executor's."""
        stats = {f"in_{k}": v for k, v in self._in.dropped.items()}
        stats["denied_handshakes"] = self._plane.denied
        executor = self.core.executor
        if hasattr(executor, "data_plane_stats"):
            stats.update({f"executor_{k}": v for k, v in executor.data_plane_stats().items()})
        return stats

    def check_health(self) -> str:
        """"ok" | "recovering" (a worker group being rebuilt); on a thread of
        its own (max_concurrency), so never behind the core loop."""
        if self._loop.error is not None:
            raise EngineDeadError(self._loop.error)
        return self.core.check_health()

    def worker_pids(self) -> list[int]:
        return self.core.worker_pids()

    def shutdown(self) -> None:
        self._closing = True
        self._loop.stop()
        self._runner.join(timeout=30)
        self._reader.join(timeout=5)  # it polls self._in: close only after it stopped
        self.core.shutdown()
        self._plane.close()


@dataclass(frozen=True)
class CoreActorPlacement:
    """Where the EngineCoreActor goes inside the caller's placement group.

    Executor "ray": bundle 0 (the replica's own), no resources of its own; the
    workers take bundles 1..N. Other executors run the model inside the actor,
    so it reserves the model's resources: its own bundle (1) with a CPU and
    the GPUs."""
    bundle_index: int = 0
    num_cpus: float = 0.0
    num_gpus: float = 0.0


class InputSender:
    """Sends CoreInputs to the actor from a thread of its own, in the order
    they were put: put() never blocks, so the HTTP event loop never waits on a
    slow or dead engine actor. The thread owns the socket (ZMQ sockets are not
    thread-safe). Once the engine is dead (`dead()` says why), what is left is
    dropped: nothing runs there any more."""

    RETRY_S = 0.001

    def __init__(self, channel: Channel, dead: Callable[[], str | None]) -> None:
        self._ch, self._dead = channel, dead
        self._queue: queue.SimpleQueue[CoreInput | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="core-inputs-send")
        self._thread.start()

    def put(self, msg: CoreInput) -> None:
        self._queue.put(msg)

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            payload = self._ch.encode(msg)
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


class RayCoreClient:
    """CoreClient over an EngineCoreActor (the process boundary of DESIGN §3)."""

    def __init__(self, config: EngineConfig, placement: CoreActorPlacement | None = None) -> None:
        self.started_ray = ensure_ray(config)
        self.config = config
        keys = PlaneKeys.generate()
        place = placement or CoreActorPlacement()
        opts: dict[str, Any] = {"num_cpus": place.num_cpus, "num_gpus": place.num_gpus}
        pg = ray.util.get_current_placement_group()
        if pg is not None:  # a Serve replica: stay in its placement group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=place.bundle_index)
        self.actor = EngineCoreActor.options(**opts).remote(msgspec.msgpack.encode(config),
                                                            msgspec.msgpack.encode(keys))
        in_addr, out_addr, kv = ray.get(self.actor.addresses.remote(), timeout=STARTUP_TIMEOUT_S)
        self.kv_info = msgspec.msgpack.decode(kv, type=KVCacheInfo)
        self.keys = keys.for_clients()  # the actor alone keeps the server secret
        self._plane = DataPlane(self.keys, server=False)
        self._open_io(self._plane.push(self._plane.sealer(TO_CORE, "frontend"), connect=in_addr),
                      self._plane.pull(TO_FRONTEND, EngineCoreOutputs, connect=out_addr))

    def _open_io(self, in_channel: Channel, out_channel: Channel) -> None:
        self._in, self._out = in_channel, out_channel
        self._closing = False
        self._reader: threading.Thread | None = None
        self.dead: str | None = None
        self.status = "ok"  # the actor's last health answer
        self._sender = InputSender(in_channel, lambda: self.dead)

    def start(self, on_outputs: OutputHandler) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_outputs,), daemon=True,
                                        name="core-outputs")
        self._reader.start()

    def _read(self, on_outputs: OutputHandler) -> None:
        last_ping = time.monotonic()
        while not self._closing:
            outs = self._out.recv(timeout_ms=200)
            if outs is not None:
                on_outputs(outs)
                continue
            if time.monotonic() - last_ping > 2.0:
                last_ping = time.monotonic()
                err = self._actor_error(self.config.parallel.step_timeout_s)
                if err is not None and not self._closing:
                    self.dead = err
                    on_outputs(EngineCoreOutputs(engine_error=err))
                    return

    def _actor_error(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
        try:
            self.status = ray.get(self.actor.check_health.remote(), timeout=timeout_s) or "ok"
            return None
        except ray.exceptions.GetTimeoutError:
            return f"engine actor did not answer a health check within {timeout_s:g}s (wedged)"
        except Exception as e:  # noqa: BLE001
            return f"engine actor failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _send(self, msg: CoreInput) -> None:
        """Never blocks (the caller is the HTTP event loop): the sender thread
        sends; a known-dead engine raises here and now."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._sender.put(msg)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(CoreInput("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(CoreInput("abort", request_ids=list(request_ids)))

    def check_health(self) -> str:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        err = self._actor_error()
        if err is not None:
            raise EngineDeadError(err)
        return self.status

    def worker_pids(self) -> list[int]:
        return ray.get(self.actor.worker_pids.remote(), timeout=30)

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001 - it may already be dead
            log.info("engine actor shutdown: %r", e)
        ray.kill(self.actor, no_restart=True)
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._sender.close()  # before the plane closes its sockets
        self._plane.close()
        if self.started_ray:
            ray.shutdown()


class SyncRayEngine:
    """The EngineCore-shaped face of a RayCoreClient, for the blocking LLM class."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.client = RayCoreClient(config)
        self.kv_info = self.client.kv_info
        self._outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._live: set[str] = set()
        self.client.start(self._outputs.put)

    def add_request(self, request: EngineCoreRequest) -> None:
        # Checked by LLM's frontend; the actor's core guards what it can schedule.
        self._live.add(request.request_id)
        self.client.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._live.difference_update(request_ids)
        self.client.abort_requests(request_ids)

    def has_work(self) -> bool:
        return bool(self._live)

    def worker_pids(self) -> list[int]:
        return self.client.worker_pids()

    def step_fn(self) -> tuple[EngineCoreOutputs, bool]:
        outs = self._outputs.get()
        if outs.engine_error is not None:
            self._live.clear()
            raise EngineDeadError(outs.engine_error)
        for o in outs.outputs:
            if o.finished:
                self._live.discard(o.request_id)
        return outs, True

    def shutdown(self) -> None:
        self.client.shutdown()
