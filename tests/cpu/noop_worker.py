"""Workers for measuring the executor, swapped in through WorkerSpec.worker_class.

NoopWorker has no model: it answers every step at once with one token per
request (bench/executor_overhead.py). StepTimeline records when each step ran
on a worker, for benchmarks and the PP-overlap test, read with the
"step_timeline" RPC; the production worker loop carries neither.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EMPTY_MODEL_RUNNER_OUTPUT, KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.executors.worker_proc import RPC_METHODS


class StepTimeline:
    """Wraps a worker of class `inner` (a subclass picks it) and records the
    (step, start, end) wall times (time.time()) of its recent steps, from
    execute_model to the output. Every rank applies every step, so step
    numbers agree across ranks."""
    inner: type[Any]
    RPC_METHODS = RPC_METHODS | {"step_timeline"}

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 init_method: str | None = None) -> None:
        self.worker = self.inner(config, rank, local_rank, init_method)
        self._timeline: deque[tuple[int, float, float]] = deque(maxlen=4096)
        self._steps = 0
        self._step_start = 0.0

    def __getattr__(self, name: str) -> Any:  # every other Worker method
        return getattr(self.worker, name)

    def execute_model(self, so: SchedulerOutput) -> Any:
        self._step_start = time.time()
        out = self.worker.execute_model(so)
        if out is not None:  # the worker loop calls no sample_tokens
            self._end_step()
        return out

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        out = self.worker.sample_tokens(grammar_output)
        self._end_step()
        return out

    def _end_step(self) -> None:
        self._steps += 1
        self._timeline.append((self._steps, self._step_start, time.time()))

    def step_timeline(self) -> list[float]:
        return [x for t in self._timeline for x in t]


class NoopWorker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 init_method: str | None = None) -> None:
        self.config = config
        self._last: SchedulerOutput | None = None

    def init_device(self) -> None:
        return None

    def load_model(self) -> None:
        return None

    def determine_num_blocks(self) -> int:
        return self.config.cache.num_gpu_blocks or 100_000

    def initialize_cache(self, num_blocks: int) -> None:
        return None

    def kv_info(self, num_blocks: int) -> KVCacheInfo:
        return KVCacheInfo(num_blocks, self.config.cache.block_size)

    def param_bytes(self) -> int:
        return 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._last = so
        return None

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        so, self._last = self._last, None
        ids = list(so.num_scheduled_tokens) if so is not None else []
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[7] for _ in ids])

    def shutdown(self) -> None:
        return None


class TimedNoopWorker(StepTimeline):
    inner = NoopWorker
