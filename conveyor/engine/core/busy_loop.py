"""EngineBusyLoop: input queue -> EngineCore step -> output handler.

The seed's EngineCoreProc loop. It runs wherever the EngineCore lives: a
thread of this process (conveyor/engine/core/inproc_client.py) or an EngineCoreActor
(conveyor/cluster/engine_actor/)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import cast

from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from conveyor.engine.core_client import OutputHandler
from conveyor.engine.dp.router.events import KVEvents
from conveyor.engine.errors import DeadFlag

log = logging.getLogger(__name__)


class EngineBusyLoop:
    """input queue -> step_fn -> output handler. A step that raises ends the loop with an `engine_error` message to the frontend;
    the engine is dead from then on."""

    def __init__(self, core, on_outputs: OutputHandler, dead: DeadFlag | None = None) -> None:
        self.core = core
        self.on_outputs = on_outputs
        self.inputs: queue.Queue[tuple[str, object]] = queue.Queue()
        self.dead = dead if dead is not None else DeadFlag()  # the client's, in process
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
            req = cast(EngineCoreRequest, payload)  # the kind names the payload's type
            try:
                self.core.add_request(req)
            except ValueError as e:  # validated upstream; report, do not die
                self.on_outputs(EngineCoreOutputs([EngineCoreOutput(
                    req.request_id, [], FinishReason.ERROR, error=str(e))]))
        elif kind == "abort":
            self.core.abort_requests(payload)
            if not self.core.has_work():
                # Idle after the abort: no step will publish fresh stats, so
                # send them now (KV usage back to 0, nothing running).
                self.on_outputs(EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats()))
        elif kind == "kv_snapshot":
            self.on_outputs(EngineCoreOutputs(kv_events=self.core.kv_snapshot()))
        elif kind == "stop":
            self._stop.set()

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inputs(block=not self.core.has_work())
                if self._stop.is_set() or not self.core.has_work():
                    continue
                outs, executed = self.core.step_fn()
                if self.core.kv_events is not None:  # data parallel only
                    outs = _with_kv_events(outs, self.core.drain_kv_events())
                if outs is not None and (outs.outputs or outs.scheduler_stats is not None
                                         or outs.kv_events is not None):
                    self.on_outputs(outs)
                if not executed and self.core.has_work():
                    time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001 - everything becomes an engine error
            log.exception("engine core loop died")
            self.dead.set(f"{type(e).__name__}: {e}")
            self.on_outputs(EngineCoreOutputs(engine_error=self.dead.cause))

    @property
    def error(self) -> str | None:
        """Why the loop died (None while it runs)."""
        return self.dead.cause

    def stop(self) -> None:
        self.submit("stop", None)


def _with_kv_events(outs: EngineCoreOutputs | None, ev: KVEvents | None) -> EngineCoreOutputs | None:
    if ev is None:
        return outs
    if outs is None:
        outs = EngineCoreOutputs()
    outs.kv_events = ev
    return outs
