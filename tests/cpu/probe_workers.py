"""Worker classes tests hand to executor "mp" through WorkerSpec.worker_class.
Spawned worker processes import them as "probe_workers:NAME" (spawn passes the
test's sys.path on); production workers carry no test hook."""
from __future__ import annotations

import pytest
from noop_worker import StepTimeline

from conveyor.engine.contracts import ModelRunnerOutput, SchedulerOutput
from conveyor.workers.worker import Worker

FAULT_RANK, FAULT_STEP = 1, 3


class FaultyWorker(Worker):
    """Rank FAULT_RANK raises on its FAULT_STEP-th step: one failing rank must
    fail the step on the driver instead of hanging it."""
    steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.steps += 1
        if self.rank == FAULT_RANK and self.steps == FAULT_STEP:
            raise RuntimeError(f"injected fault at step {self.steps}")
        return super().execute_model(so)


class TimedWorker(StepTimeline):
    """The real Worker plus the "step_timeline" RPC."""
    inner = Worker


def use_worker_class(monkeypatch: pytest.MonkeyPatch, worker_class: str) -> None:
    """Executor "mp" builds its ranks from worker_class for this test."""
    from conveyor import executors
    from conveyor.executors.multiproc import MultiprocExecutor

    def factory(config):
        ex = MultiprocExecutor(config)
        ex.worker_class = worker_class
        return ex

    monkeypatch.setitem(executors.EXECUTORS, "mp", factory)
