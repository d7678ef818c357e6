"""EngineCore: the schedule -> execute -> sample -> update loop.

step() runs one step synchronously. step_with_batch_queue() keeps up to
`max_concurrent_batches` steps in flight (pipeline parallelism): it schedules a
new batch whenever it can and blocks on the oldest one only when the queue is
full or nothing more can be scheduled.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from concurrent.futures import Future
from typing import cast

from conveyor.engine.config import ConfigError, EngineConfig
from conveyor.engine.contracts import (
    EngineCoreOutputs,
    EngineCoreRequest,
    KVCacheInfo,
    ModelRunnerOutput,
    RequestStatus,
    SchedulerOutput,
)
from conveyor.engine.core.async_scheduling import must_wait, use_async_scheduling
from conveyor.engine.core.recovery import RestartBudget, rebuild_executor, record_recovery, recovery_enabled
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.dp.router.events import EngineLoad, KVEventPublisher, KVEvents
from conveyor.engine.kv_cache.manager import cdiv
from conveyor.engine.kv_connector.registry import make_scheduler_connector
from conveyor.engine.sampling_params import resolved_max_tokens
from conveyor.engine.structured_output.manager import StructuredOutputManager
from conveyor.executors.base import EngineDeadError, Executor

log = logging.getLogger(__name__)

_Entry = tuple["Future[ModelRunnerOutput]", SchedulerOutput]


def check_kv_pool_fits(config: EngineConfig, kv: KVCacheInfo) -> None:
    """Refuse to start when one max_model_len request cannot fit the KV pool
    alone (vLLM does the same): such a request would wait forever. Block 0 is
    the null block, so num_blocks - 1 are usable."""
    usable, bs, max_len = kv.num_blocks - 1, kv.block_size, config.max_model_len
    need = cdiv(max_len, bs)
    if need <= usable:
        return
    knob = ("raise cache.num_gpu_blocks" if config.cache.num_gpu_blocks is not None
            else "give the KV cache more memory (cache.gpu_memory_utilization on GPU, "
                 "cache.cpu_kv_cache_bytes on CPU)")
    raise ConfigError(
        f"the KV cache holds {usable} usable blocks of {bs} tokens ({usable * bs} tokens), but one "
        f"request of model.max_model_len = {max_len} tokens needs {need} blocks: {knob} to at least "
        f"{need + 1} blocks (the null block included), or lower model.max_model_len to {usable * bs} "
        f"or less")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, log_stats: bool = True) -> None:
        self.config = config
        self.executor = executor
        try:
            self.kv_info: KVCacheInfo = executor.initialize()
            check_kv_pool_fits(config, self.kv_info)
        except BaseException:
            # A half-started executor holds processes, sockets or (uniproc) this
            # process's torch.distributed world: without this, the next engine
            # built in this process fails with "init_distributed was already called".
            executor.shutdown()
            raise
        self.structured_output_manager = make_structured_output_manager(config, self.kv_info.vocab_size)
        self.scheduler = Scheduler(config, self.kv_info.num_blocks, log_stats,
                                   self.structured_output_manager,
                                   make_scheduler_connector(config, self.kv_info))
        self.batch_queue_size = executor.max_concurrent_batches
        self.batch_queue: deque[_Entry] | None = deque() if self.batch_queue_size > 1 else None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.async_scheduling = use_async_scheduling(config, executor)
        if self.async_scheduling:  # one step in flight while the next is planned
            self.scheduler.async_scheduling = True
            self.batch_queue = deque()
            self.step_fn = self.step_async
        p = config.parallel
        self._restarts = RestartBudget(p.max_restarts, p.restart_window_s) if recovery_enabled(config) else None
        self.num_restarts = 0
        self.recovering = False
        self._recovery_started = 0.0
        # Aborts may arrive from other threads while a step is in flight.
        self._aborts: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        # Data parallel: the router's view of this engine's prefix cache
        # (None with one engine: the step loop pays nothing).
        self.kv_events = KVEventPublisher() if config.parallel.data_parallel_size > 1 else None
        self._hook_kv_events()

    def _hook_kv_events(self) -> None:
        if self.kv_events is not None:
            self.scheduler.kv_cache_manager.block_pool.events = self.kv_events
            if self.scheduler.connector is not None:
                self.scheduler.connector.attach_events(self.kv_events)

    def _kv_load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(len(s.waiting), len(s.running), s.kv_cache_manager.get_num_free_blocks())

    def drain_kv_events(self) -> KVEvents | None:
        """The router's events since the last call (step thread only)."""
        return self.kv_events.drain(self._kv_load()) if self.kv_events is not None else None

    def kv_snapshot(self) -> KVEvents | None:
        """Every block hash this engine holds (after the router saw a gap)."""
        if self.kv_events is None:
            return None
        pool = self.scheduler.kv_cache_manager.block_pool
        return self.kv_events.snapshot(list(pool.cached_block_hash_to_block), self._kv_load())

    # ---- input -------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend checked; raises ValueError (nothing
        queued) for one that could never be scheduled, so the queue never
        waits forever on its head."""
        self.check_schedulable(request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.config.max_model_len))

    def check_schedulable(self, request: EngineCoreRequest) -> None:
        """The core's own invariant, not input validation: the request fits,
        alone, in the KV pool (only the core knows the pool). A non-empty
        prompt within max_model_len is the frontend's check, made once at the
        edge (conveyor/engine/frontend/prepare.py: check_engine_limits): every request reaches
        here through Frontend.prepare, or is one of those resubmitted (recovery,
        migration) with the same prompt and max_tokens."""
        n, max_len = len(request.prompt_token_ids), self.config.max_model_len
        total = n + max(resolved_max_tokens(request.sampling_params, n, max_len), 1)
        need = cdiv(total, self.kv_info.block_size)
        if need > self.kv_info.num_blocks - 1:
            raise ValueError(f"the request needs {need} KV blocks; the pool has "
                             f"{self.kv_info.num_blocks - 1}")

    def abort_requests(self, request_ids: list[str]) -> None:
        self._aborts.put(list(request_ids))

    def _process_aborts(self) -> None:
        while True:
            try:
                ids = self._aborts.get_nowait()
            except queue.Empty:
                return
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            conn = self.scheduler.connector
            if conn is not None:  # an abort of a finished prefill leg: its KV was taken, end its lease
                for rid in ids:
                    conn.release_lease(rid)

    def has_work(self) -> bool:
        self._process_aborts()
        return (self.scheduler.has_requests() or bool(self.batch_queue)
                or (self._restarts is not None and self.executor.failure is not None))

    # ---- steps ---------------------------------------------------------------

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        try:
            return self._step()
        except EngineDeadError as e:
            return self._recover(e), False

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        try:
            return self._step_with_batch_queue()
        except EngineDeadError as e:
            return self._recover(e), False

    def step_async(self) -> tuple[EngineCoreOutputs | None, bool]:
        try:
            return self._step_async()
        except EngineDeadError as e:
            return self._recover(e), False

    def _recover(self, error: EngineDeadError) -> EngineCoreOutputs:
        """A rank is gone: rebuild the worker group and recompute every
        unfinished request (prompt + the tokens it already has), within the
        restart budget; past it, or without capacity, re-raise (fail fast).
        Returns the stats after the rebuild (restart count, KV usage 0)."""
        p, failure = self.config.parallel, self.executor.describe_failure()
        if self._restarts is None or not self._restarts.take():
            why = ("no recovery with this executor" if self._restarts is None else
                   f"restart budget spent: parallel.max_restarts={p.max_restarts} per {p.restart_window_s:g}s")
            log.error("worker group failed: %s; %s, the engine fails", failure, why)
            raise error
        log.warning("worker group failed: %s; rebuilding it (restart %d, at most %d per %gs)",
                    failure, self.num_restarts + 1, p.max_restarts, p.restart_window_s)
        from conveyor.executors import make_executor

        self.recovering = True
        self._recovery_started = start = time.monotonic()
        try:
            self.executor, self.kv_info = rebuild_executor(self.config, self.executor, make_executor)
        except EngineDeadError as e:
            log.error("worker group not rebuilt, the engine fails: %s", e)
            raise
        finally:
            self.recovering = False
        if self.batch_queue is not None:
            self.batch_queue.clear()  # those steps' outputs died with the group
        self.scheduler.reset_for_new_workers(self.kv_info.num_blocks)
        if self.kv_events is not None:  # the new group's cache starts empty
            self.kv_events.cleared()
            self._hook_kv_events()
        self.num_restarts += 1
        took = time.monotonic() - start
        self.scheduler.recovery_stats = record_recovery(self.scheduler.recovery_stats, took)
        log.warning("worker group rebuilt in %.2fs (worker pids %s); %d unfinished requests resume",
                    took, self.executor.worker_process_ids(), len(self.scheduler.waiting))
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats() if self.scheduler.log_stats
                                 else None)

    def _raise_if_group_failed(self) -> None:
        """A group that died while the engine was idle is rebuilt on the next
        step (has_work() says there is one), not on the next request."""
        failed = self.executor.failure
        if failed is not None and self._restarts is not None:
            raise EngineDeadError(failed)

    def check_health(self) -> str:
        """"ok", or "recovering" while a lost worker group is rebuilt (or is
        about to be) within the restart budget; raises EngineDeadError when
        the engine cannot go on. Runs on the caller's thread, never behind the
        step loop (which may be busy rebuilding)."""
        if self.recovering:
            limit = self.config.parallel.recovery_timeout_s
            if time.monotonic() - self._recovery_started > limit:
                raise EngineDeadError(f"worker group not rebuilt within parallel.recovery_timeout_s={limit:g}s")
            return "recovering"
        try:
            self.executor.check_health()
        except EngineDeadError:
            if self._restarts is None or not self._restarts.available():
                raise
            return "recovering"
        return "ok"

    def worker_pids(self) -> list[int]:
        """Live worker process ids in rank order."""
        return self.executor.worker_process_ids()

    def _step(self) -> tuple[EngineCoreOutputs, bool]:
        self._process_aborts()
        self._raise_if_group_failed()
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        so = self.scheduler.schedule()
        if so.has_structured_output and self.executor.overlaps_host_work:
            out = self._execute_overlapping_grammar(so)
        else:
            # On CPU the forward's threads hold every core: host work beside it
            # oversubscribes them, so the bitmask (None when nothing is
            # structured) comes first.
            grammar_output = self.scheduler.get_grammar_bitmask(so)
            # Blocking calls return the value itself, not a future.
            forward = cast("ModelRunnerOutput | None", self.executor.execute_model(so))
            out = forward if forward is not None else cast(
                ModelRunnerOutput, self.executor.sample_tokens(grammar_output))
        self._process_aborts()
        return self.scheduler.update_from_output(so, out), so.total_num_scheduled_tokens > 0

    def _execute_overlapping_grammar(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The seed's order on an accelerator: launch the forward, compute the
        bitmask while it runs, then sample with it."""
        self.executor.execute_model(so, non_block=True)
        grammar_output = self.scheduler.get_grammar_bitmask(so)
        # The forward's own errors surface through the sample future.
        return _pending(self.executor.sample_tokens(grammar_output, non_block=True)).result()

    def _step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        bq = self.batch_queue
        assert bq is not None
        self._process_aborts()
        self._raise_if_group_failed()
        executed = False
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            executed = so.total_num_scheduled_tokens > 0
            if executed:
                self.executor.execute_model(so, non_block=True)
                grammar_output = self.scheduler.get_grammar_bitmask(so)
                fut = _pending(self.executor.sample_tokens(grammar_output, non_block=True))
            else:
                fut = _pending(self.executor.execute_model(so, non_block=True))
            bq.appendleft((fut, so))
            if executed and len(bq) < self.batch_queue_size and not bq[-1][0].done():
                return None, True  # room for another batch: do not block yet
        elif not bq:
            return None, False
        fut, so = bq.pop()
        out = fut.result()
        self._process_aborts()
        return self.scheduler.update_from_output(so, out), executed

    def _step_async(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Plan and launch step N+1, then finish step N (conveyor/engine/core/async_scheduling.py).
        The first step of a busy period returns at once (None) so the next
        call plans its successor while it runs."""
        bq = self.batch_queue
        assert bq is not None
        self._process_aborts()
        self._raise_if_group_failed()
        sched = self.scheduler
        if sched.has_requests() and not (bq and must_wait(sched)):
            so = sched.schedule()
            bq.append((self._launch(so), so))
            if len(bq) == 1 and so.total_num_scheduled_tokens > 0:
                return None, True
        if not bq:
            return None, False
        fut, so = bq.popleft()
        out = fut.result()
        self._process_aborts()
        return sched.update_from_output(so, out), so.total_num_scheduled_tokens > 0

    def _launch(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send one step to the workers without waiting; the future holds its output."""
        ex = self.executor
        if so.total_num_scheduled_tokens == 0:
            return _pending(ex.execute_model(so, non_block=True))  # finished ids still reach the workers
        if ex.overlaps_host_work:  # the mask is built while the forward runs
            ex.execute_model(so, non_block=True)
            return _pending(ex.sample_tokens(self.scheduler.get_grammar_bitmask(so), non_block=True))
        grammar_output = self.scheduler.get_grammar_bitmask(so)  # CPU: before the forward
        ex.execute_model(so, non_block=True)
        return _pending(ex.sample_tokens(grammar_output, non_block=True))

    def shutdown(self) -> None:
        self._flush_kv_connector()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()

    def _flush_kv_connector(self) -> None:
        """Transfers decided after the last step (a finished request's blocks
        to disk, deletes) reach the workers before they go: a restart finds them."""
        conn = self.scheduler.connector
        for _ in range(3):
            if conn is None or not conn.has_pending() or self.executor.failure is not None:
                return
            try:
                self.step_fn()
            except Exception:  # noqa: BLE001 - shutting down: what is lost is recomputed later
                log.exception("KV connector: the last transfers did not reach the workers")
                return


def _pending(fut: object) -> Future[ModelRunnerOutput]:
    """What execute_model / sample_tokens return with non_block=True: a future of
    the step's output (an empty step's is EMPTY_MODEL_RUNNER_OUTPUT, never None)."""
    return cast("Future[ModelRunnerOutput]", fut)


def make_structured_output_manager(config: EngineConfig, vocab_size: int) -> StructuredOutputManager:
    from conveyor.engine.frontend.prepare import eos_token_id_of

    so = config.structured_outputs
    return StructuredOutputManager(so.backend, config.model.tokenizer or config.model.path,
                                   vocab_size, lambda: eos_token_id_of(config), so.compile_threads,
                                   so.allow_additional_properties)
