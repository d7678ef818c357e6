"""A Worker with no model: it answers every step at once with one token per
request. Measures the executor's own overhead (bench/executor_overhead.py)."""
from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.contracts import EMPTY_MODEL_RUNNER_OUTPUT, KVCacheInfo, ModelRunnerOutput, SchedulerOutput


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
