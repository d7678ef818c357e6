"""Recovery from a lost worker rank: a restart budget and the rebuild of an
executor. EngineCore owns both; what is recomputed is the scheduler's business
(Scheduler.reset_for_new_workers)."""
from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo, RecoveryStats
from conveyor.executors.base import EngineDeadError, Executor

log = logging.getLogger(__name__)

RECOVERABLE_EXECUTORS = ("mp", "ray")
# Upper bounds (s) of conveyor:engine_recovery_seconds: a tiny CPU model
# rebuilds in seconds, a large one reloads weights for minutes.
RECOVERY_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def record_recovery(stats: RecoveryStats | None, seconds: float) -> RecoveryStats:
    """One more rebuild that took `seconds` (stats mutated in place, or made)."""
    stats = stats or RecoveryStats(seconds_buckets=[0] * (len(RECOVERY_BUCKETS_S) + 1))
    stats.restarts += 1
    stats.seconds_buckets[bisect.bisect_left(RECOVERY_BUCKETS_S, seconds)] += 1
    stats.seconds_sum += seconds
    return stats


class RestartBudget:
    """At most max_restarts restarts in any restart_window_s."""

    def __init__(self, max_restarts: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._times: deque[float] = deque()
        self._lock = threading.Lock()  # health probes ask from other threads

    def available(self) -> bool:
        with self._lock:
            return self._available()

    def _available(self) -> bool:
        now = self.clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) < self.max_restarts

    def take(self) -> bool:
        with self._lock:
            if not self._available():
                return False
            self._times.append(self.clock())
            return True


def recovery_enabled(config: EngineConfig) -> bool:
    p = config.parallel
    return p.executor in RECOVERABLE_EXECUTORS and p.max_restarts > 0


def rebuild_executor(config: EngineConfig, old: Executor,
                     make: Callable[[EngineConfig], Executor]) -> tuple[Executor, KVCacheInfo]:
    """Tear the old worker group down and start a new one (a new placement
    group with Ray, so surviving nodes can take it), retrying until
    parallel.recovery_timeout_s; then raise EngineDeadError."""
    try:
        old.shutdown()
    except Exception as e:  # noqa: BLE001 - the old group is already broken
        log.warning("shutting down the failed worker group: %r", e)
    deadline = time.monotonic() + config.parallel.recovery_timeout_s
    while True:
        executor = make(config)
        try:
            return executor, executor.initialize()
        except Exception as e:  # noqa: BLE001 - retried, then reported
            try:
                executor.shutdown()
            except Exception as stop_error:  # noqa: BLE001 - the retry goes on regardless
                log.warning("shutting down the failed worker group: %r", stop_error)
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"no new worker group within parallel.recovery_timeout_s="
                    f"{config.parallel.recovery_timeout_s:g}s: {e!r}") from e
            log.warning("rebuilding the worker group failed (%r); retrying", e)
            time.sleep(1.0)
