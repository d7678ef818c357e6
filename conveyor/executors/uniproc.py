"""UniProcExecutor: one Worker in this process.

Non-blocking calls run on one background thread, so execute_model and
sample_tokens of consecutive steps stay in order."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.executors.base import EngineDeadError, Executor


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        if config.world_size != 1:
            raise ValueError(f"the uniproc executor runs one rank; tensor_parallel_size × "
                             f"pipeline_parallel_size = {config.world_size}: use executor='ray'")
        from conveyor.workers.worker import Worker

        self.config = config
        self.worker = Worker(config)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-worker")
        self._failed: BaseException | None = None
        # The worker runs in this process, so nothing can interrupt a wedged
        # step; the health check still reports one that overran its bound.
        self._busy_since: float | None = None
        self._bound_s = config.parallel.step_timeout_s + config.parallel.first_step_extra_s

    def initialize(self) -> KVCacheInfo:
        w = self.worker
        w.init_device()
        self.overlaps_host_work = w.device.type == "cuda"
        w.load_model()
        num_blocks = w.determine_num_blocks()
        w.initialize_cache(num_blocks)
        return w.kv_info(num_blocks)

    def _call(self, fn: Any, *args: Any) -> Any:
        self._busy_since = time.monotonic()
        try:
            return fn(*args)
        except BaseException as e:
            self._failed = e
            raise
        finally:
            self._busy_since = None
            self._bound_s = self.config.parallel.step_timeout_s  # the first step is done

    def execute_model(self, so: SchedulerOutput, non_block: bool = False
                      ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        if non_block:
            return self._pool.submit(self._call, self.worker.execute_model, so)
        return self._call(self.worker.execute_model, so)

    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block:
            return self._pool.submit(self._sample_after_execute, grammar_output)
        return self._call(self.worker.sample_tokens, grammar_output)

    def _sample_after_execute(self, grammar_output: Any) -> ModelRunnerOutput:
        if self._failed is not None:  # execute_model of this step raised
            raise EngineDeadError(f"model execution failed: {self._failed!r}") from self._failed
        return self._call(self.worker.sample_tokens, grammar_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def check_health(self) -> None:
        if self._failed is not None:
            raise EngineDeadError(f"engine failed: {self._failed!r}")
        since = self._busy_since
        if since is not None and time.monotonic() - since > self._bound_s:
            raise EngineDeadError(f"a step has run for over {self._bound_s:g}s "
                                  f"(parallel.step_timeout_s): the worker is wedged")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.worker.shutdown()
