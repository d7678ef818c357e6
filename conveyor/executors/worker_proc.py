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
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.executors.channel import Channel, DataPlane, PlaneKeys
from conveyor.executors.messages import TO_EXECUTOR, TO_WORKERS, WorkerCommand, WorkerReply, rank_sender

log = logging.getLogger(__name__)

# The worker methods the driver may call by name (collective_rpc). A worker
# class may offer more through its own RPC_METHODS (a frozenset).
RPC_METHODS = frozenset({"init_device", "load_model", "determine_num_blocks", "initialize_cache",
                         "kv_info", "param_bytes"})


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    init_method: str
    command_address: str  # this worker's PULL end (executor binds PUSH)
    reply_address: str  # the executor's PULL
    keys: PlaneKeys  # the client half (PlaneKeys.for_clients)
    parent_pid: int | None = None  # exit when this process disappears
    # "module:Class" of the worker: the one seam through which benchmarks and
    # tests swap in a no-op, wedging or failing worker (tests/cpu/noop_worker.py, hang_worker.py).
    worker_class: str = "conveyor.workers.worker:Worker"


@dataclass(frozen=True)
class _Dispatch:
    rank: int
    output_rank: bool  # replies to steps
    rpc_methods: frozenset[str]


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
    how = _Dispatch(spec.rank, is_output_rank(config, spec.rank),
                    getattr(worker, "RPC_METHODS", RPC_METHODS))
    try:
        while True:
            cmd = cmds.recv(timeout_ms=1000)
            if cmd is None:
                if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
                    return  # the driver died: do not linger as an orphan
                continue
            if cmd.kind == "shutdown":
                return
            reply: WorkerReply | None
            try:
                reply = _handle(worker, cmd, how, lambda: _await_grammar(cmds, spec))
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


def _handle(worker: Any, cmd: WorkerCommand, how: _Dispatch,
            next_command: Callable[[], WorkerCommand]) -> WorkerReply | None:
    rank = how.rank
    if cmd.kind == "step":
        so = cmd.scheduler_output
        assert so is not None  # a step command always carries its SchedulerOutput
        out = worker.execute_model(so)
        grammar = None
        if so.has_structured_output:
            g = next_command()
            if g.kind != "grammar" or g.step_id != cmd.step_id:
                raise RuntimeError(f"step {cmd.step_id} expected its grammar, got {g.kind!r} {g.step_id}")
            grammar = g.grammar_output
        if out is None:
            out = worker.sample_tokens(grammar)
        return WorkerReply(rank, cmd.step_id, output=out) if how.output_rank else None
    if cmd.kind == "rpc" and cmd.method in how.rpc_methods:
        value = getattr(worker, cmd.method)(*cmd.args)
        if isinstance(value, int):
            return WorkerReply(rank, cmd.step_id, value=value)
        if isinstance(value, list):
            return WorkerReply(rank, cmd.step_id, floats=value)
        if value is not None and hasattr(value, "num_blocks"):
            return WorkerReply(rank, cmd.step_id, kv_info=value)
        return WorkerReply(rank, cmd.step_id)
    raise ValueError(f"unknown command {cmd.kind!r} {cmd.method!r}")
