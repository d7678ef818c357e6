"""A model-free worker whose output rank wedges (alive, never answering) on its
second forward step: what a rank stuck in a collective or a kernel looks like
to the driver. Imported by spawned worker processes as "hang_worker:HangWorker"
(spawn passes the test's sys.path on)."""
from __future__ import annotations

import threading

from noop_worker import NoopWorker

from conveyor.engine.contracts import ModelRunnerOutput, SchedulerOutput

HANG_AT_STEP = 2


class HangWorker(NoopWorker):
    def __init__(self, config, rank: int = 0, local_rank: int = 0, init_method=None) -> None:
        super().__init__(config, rank, local_rank, init_method)
        self.rank = rank
        self.forward_steps = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if so.total_num_scheduled_tokens > 0:
            self.forward_steps += 1
            if self.rank == 0 and self.forward_steps == HANG_AT_STEP:
                threading.Event().wait()  # wedged: alive, never returns
        return super().execute_model(so)
