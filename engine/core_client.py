"""The boundary between a frontend and an EngineCore.

CoreClient is the protocol; InProcCoreClient runs EngineCore's busy loop in a
background thread of this process (tests, single-process serving);
SyncCoreEngine gives any CoreClient the EngineCore shape the blocking LLM
class steps. Clients whose core runs elsewhere (executor "ray": an
EngineCoreActor) are plugins: engine/ never imports them. They register a
factory per executor (register_core_client) when their module is imported,
and make_core_client finds the module through the PLUGIN_GROUP entry points
(pyproject.toml), so the import arrow runs one way: cluster -> engine.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
import queue
import threading
import time
import tomllib
from collections.abc import Callable
from typing import Protocol, cast

from engine.config import ConfigError, EngineConfig
from engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, KVCacheInfo
from engine.errors import EngineDeadError
from engine.router.events import KVEvents

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
            self.error = f"{type(e).__name__}: {e}"
            self.on_outputs(EngineCoreOutputs(engine_error=self.error))

    def stop(self) -> None:
        self.submit("stop", None)


def _with_kv_events(outs: EngineCoreOutputs | None, ev: KVEvents | None) -> EngineCoreOutputs | None:
    if ev is None:
        return outs
    if outs is None:
        outs = EngineCoreOutputs()
    outs.kv_events = ev
    return outs


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

    def request_kv_snapshot(self) -> None:
        """The router saw a gap in this engine's events: send a full snapshot."""
        self._require().submit("kv_snapshot", None)

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


class SyncCoreEngine:
    """The EngineCore-shaped face of a CoreClient, for the blocking LLM class:
    step_fn() waits for the next outputs; an engine error raises."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.kv_info = client.kv_info
        self._outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._live: set[str] = set()
        client.start(self._outputs.put)

    def add_request(self, request: EngineCoreRequest) -> None:
        # Checked by LLM's frontend; the remote core guards what it can schedule.
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


# ---- out-of-process core clients (plugins) ---------------------------------------

CoreClientFactory = Callable[[EngineConfig], CoreClient]
PLUGIN_GROUP = "conveyor.core_clients"
# Executors whose core runs out of this process: a plugin must provide it.
REMOTE_CORE_EXECUTORS = ("ray",)
_FACTORIES: dict[str, CoreClientFactory] = {}
_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def register_core_client(executor: str, factory: CoreClientFactory) -> None:
    """Called by a plugin module on import: `factory(config)` builds the
    CoreClient of engines with parallel.executor == executor."""
    _FACTORIES[executor] = factory


def remote_core_factory(config: EngineConfig) -> CoreClientFactory | None:
    """The factory of the config's out-of-process core (None: the core runs in
    this process). Raises ConfigError when no plugin provides it."""
    executor = config.parallel.executor
    if executor not in REMOTE_CORE_EXECUTORS:
        return None
    if executor not in _FACTORIES:
        _load_plugin(executor)
    return _FACTORIES[executor]


def make_core_client(config: EngineConfig) -> CoreClient:
    """The client of the config's engine; with parallel.data_parallel_size > 1,
    of its N engines behind the router (engine/dp_engine.py)."""
    if config.parallel.data_parallel_size > 1:
        from engine.dp_engine import DataParallelClient

        return DataParallelClient(config)
    return make_single_core_client(config)


def make_single_core_client(config: EngineConfig) -> CoreClient:
    factory = remote_core_factory(config)
    return factory(config) if factory is not None else InProcCoreClient(config)


def _load_plugin(executor: str) -> None:
    """Import the module an entry point names: the source tree's pyproject.toml
    first (a checkout that is run, not installed, or installed from an older
    pyproject), then the installed distributions' metadata."""
    eps = _source_tree_entry_points() + list(importlib.metadata.entry_points(group=PLUGIN_GROUP))
    for ep in eps:
        if ep.name != executor:
            continue
        factory = ep.load()
        _FACTORIES.setdefault(executor, factory)
        return
    raise ConfigError(f"parallel.executor={executor!r} needs a core client plugin: no "
                      f"{PLUGIN_GROUP!r} entry point named {executor!r} (pyproject.toml declares it; "
                      f"reinstall with `pip install -e .`)")


def _source_tree_entry_points() -> list[importlib.metadata.EntryPoint]:
    if not os.path.isfile(_PYPROJECT):
        return []
    with open(_PYPROJECT, "rb") as f:
        table = tomllib.load(f).get("project", {}).get("entry-points", {}).get(PLUGIN_GROUP, {})
    return [importlib.metadata.EntryPoint(name, value, PLUGIN_GROUP) for name, value in table.items()]
