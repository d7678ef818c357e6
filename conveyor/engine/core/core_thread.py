"""CoreThread: an EngineCore built, then stepped, on one thread of its own
(InProcCoreClient, and the EngineCoreActor in its Ray process).

The model loads, warms up and steps on one OS thread. libgomp keeps a worker
pool per thread that opens parallel regions; once two pools manage more
threads than the process has cores, every pool's workers stop spinning between
regions and each region pays a futex wake-up. Built in the caller and stepped
in a thread, a 30M LLaVA's 16-row decode forward took 21 ms against 15.8 ms on
one thread (2-core Xeon), and a 300x512 GELU 120 us against 40 us
(docs/benchmarks-history.md, 2026-12-07).

The step thread shares the GIL with the process's other Python threads (a
server's event loop, its image preprocessing). Between two torch ops it needs
the GIL back, and while another thread runs Python it waits up to the
interpreter's switch interval (5 ms by default) with both cores' OpenMP
threads idle. Starting a core lowers the process's interval to
STEP_SWITCH_INTERVAL_S: served 16-image LLaVA waves ran 1.944 s against
2.020 s (medians of 4 alternating, each wave faster; 2048-token steps 528
against 551 ms), decode steps unchanged (docs/benchmarks-history.md,
2026-12-07 (evening))."""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from conveyor.engine.config import EngineConfig

STEP_SWITCH_INTERVAL_S = 0.0005


class CoreThread:
    """Builds the core on a new thread and returns once it is built (or
    re-raises what the build raised). The thread then waits for ``go``."""

    def __init__(self, config: EngineConfig, name: str,
                 prepare: Callable[[], None] | None = None) -> None:
        """``prepare`` runs on the thread before the build (e.g. pinning it to
        cores, so torch's threads inherit them)."""
        self._go = threading.Event()
        self._run: Callable[[], None] | None = None
        self._error: BaseException | None = None
        built = threading.Event()
        if sys.getswitchinterval() > STEP_SWITCH_INTERVAL_S:  # never raise one already lowered
            sys.setswitchinterval(STEP_SWITCH_INTERVAL_S)
        self.thread = threading.Thread(target=self._main, args=(config, prepare, built), name=name, daemon=True)
        self.thread.start()
        built.wait()
        if self._error is not None:
            raise self._error

    def _main(self, config: EngineConfig, prepare: Callable[[], None] | None, built: threading.Event) -> None:
        from conveyor.engine.core.engine_core import EngineCore
        from conveyor.executors import make_executor

        try:
            if prepare is not None:
                prepare()
            self.core = EngineCore(config, make_executor(config))
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self._error = e
            return
        finally:
            built.set()
        self._go.wait()
        if self._run is not None:
            self._run()

    def go(self, run: Callable[[], None] | None = None) -> None:
        """Let the thread go on: run ``run`` (the core's loop), or, with
        None, end. Only the first call counts."""
        if not self._go.is_set():
            self._run = run
            self._go.set()
