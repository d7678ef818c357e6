"""The worker side of the data plane: a busy loop around one Worker.

Runs in a spawned process (MultiprocExecutor) or inside a Ray actor
(RayExecutor). Every rank applies every SchedulerOutput, so the persistent
batches of all ranks stay identical; only the output rank (TP rank 0 of the
last PP stage) replies per step. Any rank replies with the error if a command
raises, so the driver fails fast instead of waiting for a collective timeout.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from executors.channel import Channel, DataPlane, PlaneKeys
from executors.messages import TO_EXECUTOR, TO_WORKERS, WorkerCommand, WorkerReply, rank_sender

log = logging.getLogger(__name__)

RPC_METHODS = {"init_device", "load_model", "determine_num_blocks", "initialize_cache", "kv_info",
               "param_bytes"}
# Test hook: "RANK:STEP" makes that rank raise on that step command, to check
# that one failing rank fails the step on the driver instead of hanging it.
_FAULT_ENV = "CONVEYOR_INJECT_FAULT"


def _fault_point(rank: int) -> int | None:
    spec = os.environ.get(_FAULT_ENV, "")
    if ":" not in spec:
        return None
    r, step = spec.split(":", 1)
    return int(step) if int(r) == rank else None


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    init_method: str
    command_address: str  # this worker's PULL end (executor binds PUSH)
    reply_address: str  # the executor's PULL
    keys: PlaneKeys  # the client half (PlaneKeys.for_clients)
    parent_pid: int | None = None  # exit when this process disappears
    # "module:Class" of the worker; benchmarks swap in a no-op model.
    worker_class: str = "workers.worker:Worker"


def is_output_rank(config: EngineConfig, rank: int) -> bool:
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    return rank == (pp - 1) * tp


def run_worker_loop(config: EngineConfig, spec: WorkerSpec) -> None:
    import importlib

    module, _, name = spec.worker_class.partition(":")
    worker_cls = getattr(importlib.import_module(module), name)
    plane = DataPlane(spec.keys, server=False)
    cmds = plane.pull(TO_WORKERS, WorkerCommand, connect=spec.command_address)
    replies = plane.push(plane.sealer(TO_EXECUTOR, rank_sender(spec.rank)), connect=spec.reply_address)
    worker = worker_cls(config, spec.rank, spec.local_rank, spec.init_method)
    output_rank = is_output_rank(config, spec.rank)
    fault_at = _fault_point(spec.rank)
    steps = 0
    # (step id, start, end) wall times of recent steps: shows PP overlap.
    timeline: deque[tuple[int, float, float]] = deque(maxlen=4096)
    try:
        while True:
            cmd = cmds.recv(timeout_ms=1000)
            if cmd is None:
                if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
                    return  # the driver died: do not linger as an orphan
                continue
            if cmd.kind == "shutdown":
                return
            try:
                if cmd.kind == "step":
                    steps += 1
                    if steps == fault_at:
                        raise RuntimeError(f"injected fault at step {steps}")
                if cmd.kind == "rpc" and cmd.method == "step_timeline":
                    reply = WorkerReply(spec.rank, cmd.step_id, floats=[x for t in timeline for x in t])
                else:
                    t0 = time.time()
                    reply = _handle(worker, cmd, spec.rank, output_rank, lambda: _await_grammar(cmds, spec))
                    if cmd.kind == "step":
                        timeline.append((cmd.step_id, t0, time.time()))
            except Exception as e:  # noqa: BLE001 - reported to the driver
                log.exception("rank %d failed", spec.rank)
                reply = WorkerReply(spec.rank, cmd.step_id,
                                    error=f"rank {spec.rank}: {type(e).__name__}: {e}\n"
                                          f"{traceback.format_exc(limit=5)}")
            if reply is not None:
                replies.send(reply)
    finally:
        try:
            worker.shutdown()
        finally:
            plane.close()


def _await_grammar(cmds: Channel, spec: WorkerSpec) -> WorkerCommand:
    """The command after a structured step is its grammar (commands are FIFO)."""
    while True:
        cmd = cmds.recv(timeout_ms=1000)
        if cmd is not None:
            return cmd
        if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
            raise RuntimeError("the driver died while a step waited for its grammar")


def _handle(worker, cmd: WorkerCommand, rank: int, output_rank: bool,
            next_command: Callable[[], WorkerCommand]) -> WorkerReply | None:
    if cmd.kind == "step":
        so = cmd.scheduler_output
        out = worker.execute_model(so)
        grammar = None
        if so.has_structured_output:
            g = next_command()
            if g.kind != "grammar" or g.step_id != cmd.step_id:
                raise RuntimeError(f"step {cmd.step_id} expected its grammar, got {g.kind!r} {g.step_id}")
            grammar = g.grammar_output
        if out is None:
            out = worker.sample_tokens(grammar)
        return WorkerReply(rank, cmd.step_id, output=out) if output_rank else None
    if cmd.kind == "rpc" and cmd.method in RPC_METHODS:
        value = getattr(worker, cmd.method)(*cmd.args)
        if isinstance(value, int):
            return WorkerReply(rank, cmd.step_id, value=value)
        if value is not None and hasattr(value, "num_blocks"):
            return WorkerReply(rank, cmd.step_id, kv_info=value)
        return WorkerReply(rank, cmd.step_id)
    raise ValueError(f"unknown command {cmd.kind!r} {cmd.method!r}")
