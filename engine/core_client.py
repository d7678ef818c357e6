"""The boundary between a frontend and an EngineCore.

CoreClient is the protocol; InProcCoreClient runs EngineCore's busy loop in a
background thread of this process (tests, single-process serving). The Ray
client (cluster/engine_actor.py) speaks the same protocol over ZMQ to an
EngineCoreActor.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Protocol

from engine.config import EngineConfig
from engine.contracts import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                              KVCacheInfo)
from engine.errors import EngineDeadError

log = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], None]


class CoreClient(Protocol):
    kv_info: KVCacheInfo

    def start(self, on_outputs: OutputHandler) -> None: ...
    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def check_health(self) -> str: ...  # "ok" | "recovering"; raises EngineDeadError
    def worker_pids(self) -> list[int]: ...
    def shutdown(self) -> None: ...


class EngineBusyLoop:
    """input queue -> step_fn -> output handler (the seed's EngineCoreProc loop).

    Runs wherever the EngineCore lives: a thread here, or a Ray actor. A step
    that raises ends the loop with an `engine_error` message to the frontend;
    the engine is dead from then on."""

    def __init__(self, core, on_outputs: OutputHandler) -> None:
        self.core = core
        self.on_outputs = on_outputs
        self.inputs: queue.Queue[tuple[str, object]] = queue.Queue()
        self.error: str | None = None
        self._stop = threading.Event()

    def submit(self, kind: str, payload: object) -> None:
        self.inputs.put((kind, payload))

    def _drain_inputs(self, block: bool) -> None:
        try:
            kind, payload = self.inputs.get(timeout=0.05) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(kind, payload)
            try:
                kind, payload = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "add":
            req: EngineCoreRequest = payload  # type: ignore[assignment]
            try:
                self.core.add_request(req)
            except ValueError as e:  # validated upstream; report, do not die
                self.on_outputs(EngineCoreOutputs([EngineCoreOutput(
                    req.request_id, [], FinishReason.ERROR, error=str(e))]))
        elif kind == "abort":
            self.core.abort_requests(payload)  # type: ignore[arg-type]
            if not self.core.has_work():
                # Idle after the abort: no step will publish fresh stats, so
                # send them now (KV usage back to 0, nothing running).
                self.on_outputs(EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats()))
        elif kind == "stop":
            self._stop.set()

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inputs(block=not self.core.has_work())
                if self._stop.is_set() or not self.core.has_work():
                    continue
                outs, executed = self.core.step_fn()
                if outs is not None and (outs.outputs or outs.scheduler_stats is not None):
                    self.on_outputs(outs)
                if not executed and self.core.has_work():
                    time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001 - everything becomes an engine error
            log.exception("engine core loop died")
            self.error = f"{type(e).__name__}: {e}"
            self.on_outputs(EngineCoreOutputs(engine_error=self.error))

    def stop(self) -> None:
        self.submit("stop", None)


class InProcCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        from engine.core import EngineCore
        from executors import make_executor

        self.core = EngineCore(config, make_executor(config))
        self.kv_info = self.core.kv_info
        self._loop: EngineBusyLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, on_outputs: OutputHandler) -> None:
        self._loop = EngineBusyLoop(self.core, on_outputs)
        self._thread = threading.Thread(target=self._loop.run, name="conveyor-core", daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._require().submit("add", request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._require().submit("abort", list(request_ids))

    def check_health(self) -> str:
        loop = self._require()
        if loop.error is not None or not (self._thread and self._thread.is_alive()):
            raise EngineDeadError(f"engine is dead: {loop.error or 'core thread exited'}")
        return self.core.check_health()

    def worker_pids(self) -> list[int]:
        return self.core.worker_pids()

    def _require(self) -> EngineBusyLoop:
        if self._loop is None:
            raise RuntimeError("core client not started")
        return self._loop

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.core.shutdown()
