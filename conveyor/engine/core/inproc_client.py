"""InProcCoreClient: the EngineCore and its busy loop in a thread of this process
(AsyncLLM when the core is not asked into an actor; data-parallel engines).

The core is built in that thread too, so its model loads, warms up and steps on
one OS thread. libgomp keeps a worker pool per thread that opens parallel
regions; once two pools manage more threads than the process has cores, every
pool's workers stop spinning between regions and each region pays a futex
wake-up. Built in the caller and stepped in the thread, a 30M LLaVA's 16-row
decode forward took 21 ms against 15.8 ms on one thread (2-core Xeon), and a
300x512 GELU 120 us against 40 us (docs/benchmarks-history.md, 2026-12-07)."""
from __future__ import annotations

import threading
from collections.abc import Callable

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest
from conveyor.engine.core.busy_loop import EngineBusyLoop
from conveyor.engine.core_client import FleetAdmin, OutputHandler
from conveyor.engine.errors import DeadFlag


class InProcCoreClient:
    started_ray = False  # LLM/AsyncLLM in this process start no Ray for it

    def __init__(self, config: EngineConfig) -> None:
        self.dead = DeadFlag()
        self._loop: EngineBusyLoop | None = None
        self._built = threading.Event()
        self._go = threading.Event()  # start() or shutdown(): the thread may go on
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(config,), name="conveyor-core", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.kv_info = self.core.kv_info

    def _main(self, config: EngineConfig) -> None:
        """The core thread: build the core, then (after start()) run its loop."""
        from conveyor.engine.core.engine_core import EngineCore
        from conveyor.executors import make_executor

        try:
            self.core = EngineCore(config, make_executor(config))
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self._build_error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        if self._loop is not None:
            self._loop.run()

    def start(self, on_outputs: OutputHandler) -> None:
        self._loop = EngineBusyLoop(self.core, on_outputs, self.dead)
        self._go.set()

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
        self._go.set()  # never started: the thread ends without a loop
        self._thread.join(timeout=30)
        self.core.shutdown()
