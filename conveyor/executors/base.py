"""The Executor contract between EngineCore and the workers.

execute_model() runs the forward pass of one SchedulerOutput and returns None
(logits kept worker-side) or a ModelRunnerOutput; sample_tokens() then samples.
With non_block=True both return concurrent.futures.Future objects so the core
can keep `max_concurrent_batches` steps in flight.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from conveyor.engine.contracts import KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.engine.errors import EngineDeadError

__all__ = ["EngineDeadError", "Executor"]  # EngineDeadError: the one class, re-exported


class Executor(ABC):
    max_concurrent_batches: int = 1
    # The forward runs on an accelerator, so host work (the grammar bitmask)
    # can overlap it. On CPU the forward's threads hold every core: host work
    # beside it oversubscribes them (measured: 720 vs 888 tok/s), so it goes first.
    overlaps_host_work: bool = False

    @abstractmethod
    def initialize(self) -> KVCacheInfo:
        """Load the model, size and allocate the KV cache, warm up."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        ...

    @abstractmethod
    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        ...

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        raise NotImplementedError

    def check_health(self) -> None:
        return None

    def worker_process_ids(self) -> list[int]:
        """Live worker process ids in rank order (this process for in-process workers)."""
        return [os.getpid()]

    @property
    def failure(self) -> str | None:
        """Why the workers are dead, once the executor knows they are (cheap: no probe)."""
        return None

    def describe_failure(self) -> str:
        """For the recovery log: which rank failed, where (node, pid) and why."""
        return "the worker in this process"

    def shutdown(self) -> None:
        return None
