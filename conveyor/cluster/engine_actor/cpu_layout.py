"""Where a CPU replica's threads run: the engine's step thread on some cores,
the replica's HTTP/Serve threads on the others (serve.frontend_cpus).

vLLM's CPU backend does the same when it serves: compute threads bound to all
but one core, that core left to the frontend. Measured on 2 cores through
Serve's proxy (BENCHMARKS.md, "Served against vLLM"): unpinned, the engine
actor got 0.86 of a core, preempted by the proxy's and the replica's per-event
wake-ups on whichever core it was on; pinned runs gave 692-770 output tok/s
against 671-705 unpinned (single runs, +-10%).

Invariants:
- Only where the model runs in the EngineCoreActor's step thread on CPU
  (parallel.engine_actor, an executor other than "ray", no GPU). Threads a pinned
  thread starts later (torch's OpenMP pool) inherit its cores.
- A split never leaves either side without a core; a node with too few cores,
  or cores that do not exist where the actor landed, pins nothing.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from conveyor.engine.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSplit:
    engine: tuple[int, ...]  # the engine's step thread (and its torch threads)
    frontend: tuple[int, ...]  # every thread of the replica process


def frontend_cpus(config: EngineConfig, use_gpu: bool) -> int:
    """serve.frontend_cpus resolved: None (auto) is 1 for one CPU replica
    whose engine actor runs the model, else 0 (several replicas on a node
    would all pick the same cores)."""
    n = config.serve.frontend_cpus
    if n is not None:
        return n
    runs_model_in_actor = config.core_in_actor(serving=True) and config.parallel.executor != "ray"
    return 1 if runs_model_in_actor and not use_gpu and config.serve.replicas == 1 else 0


def split_cpus(available: set[int], frontend: int) -> CpuSplit | None:
    """The last `frontend` cores go to the replica, the rest to the engine;
    None when that would leave either side without one."""
    cores = sorted(available)
    if frontend <= 0 or len(cores) <= frontend:
        return None
    return CpuSplit(tuple(cores[:-frontend]), tuple(cores[-frontend:]))


def plan(config: EngineConfig, use_gpu: bool) -> CpuSplit | None:
    """This node's split for one replica (computed in the replica, before it pins itself)."""
    return split_cpus(os.sched_getaffinity(0), frontend_cpus(config, use_gpu))


def pin_process(cpus: tuple[int, ...]) -> None:
    """Every thread of this process onto `cpus` (Linux affinity is per thread)."""
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that just ended
            continue


def pin_this_thread(cpus: tuple[int, ...]) -> None:
    """The calling thread onto those of `cpus` that exist here (none: unchanged)."""
    here = tuple(c for c in cpus if c in os.sched_getaffinity(0))
    if not here:
        log.info("engine cores %s are not on this node: not pinned", cpus)
        return
    os.sched_setaffinity(0, here)
