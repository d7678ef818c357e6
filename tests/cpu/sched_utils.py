"""Helpers that drive the scheduler with fake model outputs (no torch)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    EngineCoreRequest,
    KVCacheInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)
from conveyor.engine.core.request import Request
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.executors.base import Executor

EOS = 0


def create_scheduler(num_blocks: int = 10000, block_size: int = 16, max_num_seqs: int = 16,
                     max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = False,
                     max_model_len: int | None = None, **sched: Any) -> Scheduler:
    max_len = max_model_len or max_num_batched_tokens
    sched_cfg = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sched_cfg.update(sched)
    pp = sched_cfg.pop("pipeline_parallel_size", 1)
    if not sched_cfg.get("enable_chunked_prefill", True):
        max_len = min(max_len, max_num_batched_tokens)
    tree = {"model": {"max_model_len": max_len}, "scheduler": sched_cfg,
            "cache": {"block_size": block_size, "enable_prefix_caching": enable_prefix_caching},
            "parallel": {"pipeline_parallel_size": pp}}
    # Unit tests probe odd shapes (budget < max_num_seqs): skip cross-field checks.
    cfg = msgspec.convert(tree, EngineConfig)
    return Scheduler(cfg, num_blocks)


def make_request(rid: str, prompt: list[int], max_tokens: int = 16, priority: int = 0,
                 arrival_time: float = 0.0, cache_salt: str | None = None,
                 max_model_len: int = 100000, **sp: Any) -> Request:
    ecr = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                            sampling_params=SamplingParams(max_tokens=max_tokens, **sp),
                            eos_token_id=EOS, arrival_time=arrival_time, priority=priority,
                            cache_salt=cache_salt)
    return Request.from_engine_core_request(ecr, max_model_len)


def append_token(req: Request, token_id: int) -> None:
    """What the scheduler does with a sampled token, for tests that drive a Request alone."""
    req.output_token_ids.append(token_id)
    req.all_token_ids.append(token_id)


def create_requests(num_requests: int, num_tokens: int = 10, max_tokens: int = 16,
                    start: int = 0, **kw: Any) -> list[Request]:
    return [make_request(str(i), [i + 1] * num_tokens, max_tokens, **kw)
            for i in range(start, start + num_requests)]


def fake_output(so: SchedulerOutput, sched: Scheduler, token: int | Callable[[str], int] = 1
                ) -> ModelRunnerOutput:
    """One token for every scheduled request whose chunk reaches its known
    tokens (what a real worker returns); partial prefills sample nothing."""
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        tok = token(rid) if callable(token) else token
        sampled.append([tok] if done else [])
    return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled)


def scripted_token(rid: str, k: int) -> int:
    """Deterministic, never EOS."""
    return 100 + (sum(map(ord, rid)) * 31 + k) % 800


class FakeWorkerState:
    """Mirrors what a worker knows from SchedulerOutput diffs."""

    def __init__(self) -> None:
        self.known: dict[str, int] = {}  # req_id -> number of known tokens
        self.outputs: dict[str, int] = {}

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.known[nr.req_id] = len(nr.prompt_token_ids)
            self.outputs.setdefault(nr.req_id, 0)
        cached = so.scheduled_cached_reqs
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
            if rid in cached.resumed_token_ids:
                self.known[rid] = len(cached.resumed_token_ids[rid])
        ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            ids.append(rid)
            if computed[rid] + n >= self.known[rid]:
                k = self.outputs[rid]
                sampled.append([scripted_token(rid, k)])
                self.outputs[rid] = k + 1
                self.known[rid] += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled)


class FakeExecutor(Executor):
    """Scripted tokens, optional delay, `queue_size` batches in flight."""

    def __init__(self, num_blocks: int = 1000, block_size: int = 16, queue_size: int = 1,
                 delay_s: float = 0.0) -> None:
        self.max_concurrent_batches = queue_size
        self.num_blocks, self.block_size, self.delay_s = num_blocks, block_size, delay_s
        self.state = FakeWorkerState()
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.in_flight = 0
        self.max_in_flight = 0
        self.executed: list[SchedulerOutput] = []
        self._lock = threading.Lock()
        self._pending: list[ModelRunnerOutput] = []

    def initialize(self) -> KVCacheInfo:
        return KVCacheInfo(self.num_blocks, self.block_size)

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            self.executed.append(so)
            return self.state.run(so) if so.total_num_scheduled_tokens else EMPTY_MODEL_RUNNER_OUTPUT
        finally:
            with self._lock:
                self.in_flight -= 1

    def execute_model(self, so: SchedulerOutput, non_block: bool = False):
        if so.total_num_scheduled_tokens == 0:
            fut = self.pool.submit(self._run, so)
            return fut if non_block else fut.result()
        self._last = self.pool.submit(self._run, so)
        return None if not non_block else self._last

    def sample_tokens(self, grammar_output: Any = None, non_block: bool = False):
        fut = self._last
        return fut if non_block else fut.result()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
