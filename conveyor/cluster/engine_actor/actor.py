"""EngineCoreActor: EngineCore in a Ray actor, spoken to over CURVE-encrypted ZMQ.
(Its client: conveyor/cluster/engine_actor/client.py; one actor's link: conveyor/cluster/engine_actor/link.py.)

Input channel (frontend PUSH -> actor PULL): ADD / ABORT / UTILITY messages.
Output channel (actor PUSH -> frontend PULL): one EngineCoreOutputs per step.
The actor binds both (it is the CURVE server and admits only the frontend's
key); the frontend generates the plane's keys and hands them to the actor
through Ray (conveyor/executors/channel.py). Frames carry route, sender and sequence
number under a MAC; a bad frame is dropped and counted, never fatal. The
actor's workers are Ray actors of their own (RayExecutor, with a data plane of
its own), in the caller's placement group when there is one.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass

import msgspec
import ray

from conveyor.cluster.engine_actor.cpu_layout import pin_this_thread
from conveyor.cluster.engine_actor.frontends import Frontends
from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.busy_loop import EngineBusyLoop
from conveyor.engine.core.core_thread import CoreThread
from conveyor.engine.errors import EngineDeadError
from conveyor.executors.channel import DataPlane, PlaneKeys
from conveyor.executors.frames import Route
from conveyor.executors.ray_executor import cluster_host

log = logging.getLogger(__name__)


class CoreInput(msgspec.Struct, array_like=True, gc=False):
    kind: str  # "add" | "abort" | "kv_snapshot" | "utility"
    request: EngineCoreRequest | None = None
    request_ids: list[str] = msgspec.field(default_factory=list)
    method: str | None = None


TO_CORE = Route("frontend->core", "CoreInput")
TO_FRONTEND = Route("core->frontend", "EngineCoreOutputs")


# One call (wait_closed) per frontend stays pending for the actor's life: room for the rest.
@ray.remote(num_cpus=0, max_concurrency=32)
class EngineCoreActor:
    def __init__(self, config_bytes: bytes, keys_bytes: bytes,
                 engine_cpus: tuple[int, ...] = ()) -> None:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        # Built and stepped on the one "core-loop" thread (conveyor/engine/core/core_thread.py),
        # pinned first so torch's threads inherit the cores.
        pin = functools.partial(pin_this_thread, tuple(engine_cpus)) if engine_cpus else None
        self._runner = CoreThread(config, "core-loop", pin)
        self.core = self._runner.core
        host = cluster_host()
        self._plane = DataPlane(msgspec.msgpack.decode(keys_bytes, type=PlaneKeys), server=True)
        self._in = self._plane.pull(TO_CORE, CoreInput, bind_host=host)
        self._out = self._plane.push(self._plane.sealer(TO_FRONTEND, "core"), bind_host=host)
        self.frontends = Frontends(self._in, self._out, (TO_CORE, TO_FRONTEND), CoreInput)
        self._loop = EngineBusyLoop(self.core, self.frontends.send)
        self._closing = False
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_inputs, daemon=True, name="core-inputs")
        self._reader.start()
        self._runner.go(self._loop.run)

    def addresses(self) -> tuple[str, str, bytes]:
        return self._in.address, self._out.address, msgspec.msgpack.encode(self.core.kv_info)

    def _read_inputs(self) -> None:
        # recv() drops bad frames itself; this thread must outlive any input.
        while not self._closing:
            msg = self.frontends.recv(timeout_ms=200)
            if msg is None:
                continue
            if msg.kind == "add" and msg.request is not None:
                self._loop.submit("add", msg.request)
            elif msg.kind == "abort":
                self._loop.submit("abort", msg.request_ids)
            elif msg.kind == "kv_snapshot":  # the router saw a gap (data parallel)
                self._loop.submit("kv_snapshot", None)
            else:
                log.warning("ignored a core input of kind %r", msg.kind)

    def attach(self, keys_bytes: bytes) -> tuple[int, str, str, bytes]:
        """Another frontend (conveyor/cluster/engine_pool.py): its id, addresses, kv_info."""
        fid, in_addr, out_addr = self.frontends.attach(keys_bytes, cluster_host())
        return fid, in_addr, out_addr, msgspec.msgpack.encode(self.core.kv_info)

    def detach(self, fid: int) -> None:
        self._loop.submit("abort", self.frontends.detach(fid))

    def listen_addresses(self) -> list[str]:
        """Every ZMQ endpoint this actor's process binds: its input and output
        sockets, its executor's (when it has a data plane), then each attached
        frontend's input and output (conveyor/cluster/engine_pool.py)."""
        own = [self._in.address, self._out.address]
        return (own + list(getattr(self.core.executor, "listen_addresses", list)())
                + self.frontends.listen_addresses())

    def data_plane_stats(self) -> dict[str, int]:
        """Dropped frames and refused handshakes, this actor's and its executor's."""
        stats = {f"in_{k}": v for k, v in self._in.dropped.items()}
        stats["denied_handshakes"] = self._plane.denied
        executor = self.core.executor
        if hasattr(executor, "data_plane_stats"):
            stats.update({f"executor_{k}": v for k, v in executor.data_plane_stats().items()})
        if self.frontends.attached:
            stats.update({f"frontends_{k}": v for k, v in self.frontends.plane_stats().items()})
        return stats

    def check_health(self) -> str:
        """"ok" | "recovering" (a worker group being rebuilt); on a thread of
        its own (max_concurrency), so never behind the core loop."""
        if self._loop.error is not None:
            raise EngineDeadError(self._loop.error)
        return self.core.check_health()

    def worker_pids(self) -> list[int]:
        return self.core.worker_pids()

    def owned_placement_group_id(self) -> str | None:
        """The placement group its executor made, if any (see RayExecutor)."""
        return getattr(self.core.executor, "owned_placement_group_id", lambda: None)()

    def pid(self) -> int:
        """This actor's process id (the chaos tests' handle)."""
        return os.getpid()

    def wait_closed(self) -> None:
        """Returns once shut down: the client keeps one call pending, so the
        actor's death reaches it as that call's error (no polling)."""
        self._closed.wait()

    def shutdown(self) -> None:
        self._closing = True
        self._loop.stop()
        self._runner.thread.join(timeout=30)
        self._reader.join(timeout=5)  # it polls self._in: close only after it stopped
        try:
            self.core.shutdown()
            self.frontends.close()
            self._plane.close()
        finally:
            self._closed.set()


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
    engine_cpus: tuple[int, ...] = ()  # cores for its step thread (): unpinned

    @classmethod
    def of_engine(cls, config: EngineConfig, use_gpu: bool) -> CoreActorPlacement:
        """A data-parallel engine's actor, with resources of its own (executor
        "ray": its workers' placement group; otherwise the model in the actor,
        with its GPUs)."""
        p = config.parallel
        if p.executor == "ray":
            return cls()
        return cls(num_cpus=1.0 if use_gpu else p.num_cpus_per_worker,
                   num_gpus=float(config.world_size) if use_gpu else 0.0)
