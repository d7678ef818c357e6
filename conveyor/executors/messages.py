"""Messages between an executor and its workers."""
from __future__ import annotations

import msgspec

from conveyor.engine.contracts import GrammarOutput, KVCacheInfo, ModelRunnerOutput, SchedulerOutput
from conveyor.executors.frames import Route


class WorkerCommand(msgspec.Struct, array_like=True, gc=False):
    kind: str  # "step" | "grammar" | "rpc" | "shutdown"
    step_id: int = 0
    scheduler_output: SchedulerOutput | None = None
    # "grammar": the bitmask of step `step_id`, sent while its forward runs.
    grammar_output: GrammarOutput | None = None
    method: str | None = None  # rpc: a Worker method taking ints
    args: list[int] = msgspec.field(default_factory=list)


class WorkerReply(msgspec.Struct, array_like=True, gc=False):
    rank: int
    step_id: int
    output: ModelRunnerOutput | None = None
    value: int | None = None
    kv_info: KVCacheInfo | None = None
    error: str | None = None
    floats: list[float] | None = None  # an RPC that returns numbers (e.g. step_timeline)


# The two routes of an executor's data plane (bound into every frame's MAC).
TO_WORKERS = Route("executor->worker", "WorkerCommand")
TO_EXECUTOR = Route("worker->executor", "WorkerReply")
EXECUTOR_SENDER = "executor"


def rank_sender(rank: int) -> str:
    return f"rank{rank}"
