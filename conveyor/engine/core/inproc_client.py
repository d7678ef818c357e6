"""InProcCoreClient: the EngineCore and its busy loop in a thread of this process
(AsyncLLM when the core is not asked into an actor; data-parallel engines). The
core is built on that thread too (conveyor/engine/core/core_thread.py)."""
from __future__ import annotations

from collections.abc import Callable

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.busy_loop import EngineBusyLoop
from conveyor.engine.core.core_thread import CoreThread
from conveyor.engine.core_client import FleetAdmin, OutputHandler
from conveyor.engine.errors import DeadFlag


class InProcCoreClient:
    started_ray = False  # LLM/AsyncLLM in this process start no Ray for it

    def __init__(self, config: EngineConfig) -> None:
        self.dead = DeadFlag()
        self._loop: EngineBusyLoop | None = None
        self._core_thread = CoreThread(config, "conveyor-core")
        self._thread = self._core_thread.thread
        self.core = self._core_thread.core
        self.kv_info = self.core.kv_info

    def start(self, on_outputs: OutputHandler) -> None:
        self._loop = EngineBusyLoop(self.core, on_outputs, self.dead)
        self._core_thread.go(self._loop.run)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._require().submit("add", request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._require().submit("abort", list(request_ids))

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        """Never asked for (a core in this process loses no request: it
        rebuilds its own workers); answered as new adds all the same."""
        for r in requests:
            self.add_request(r)

    @property
    def admin(self) -> FleetAdmin | None:
        return None

    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None:
        pass  # a core in this process is never lost: it rebuilds its own workers

    def engine_pid(self) -> int | None:
        return None  # no process of its own

    def request_kv_snapshot(self) -> None:
        """The router saw a gap in this engine's events: send a full snapshot."""
        self._require().submit("kv_snapshot", None)

    def check_health(self) -> str:
        self._require()
        if not self._thread.is_alive():
            self.dead.set("core thread exited")
        self.dead.check()
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
        self._core_thread.go()  # never started: the thread ends without a loop
        self._thread.join(timeout=30)
        self.core.shutdown()
