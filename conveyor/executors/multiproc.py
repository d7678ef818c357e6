"""MultiprocExecutor: N worker processes on this machine without Ray
(torch.multiprocessing spawn, gloo on CPU / NCCL on CUDA, 127.0.0.1).

The test harness for tensor and pipeline parallelism; the RayExecutor runs
the very same worker loop inside Ray actors."""
from __future__ import annotations

import os
import signal
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from conveyor.engine.config import EngineConfig
from conveyor.executors.distributed import DistributedExecutor
from conveyor.executors.worker_proc import WorkerSpec, run_worker_loop


def _entry(config: EngineConfig, spec: WorkerSpec) -> None:
    run_worker_loop(config, spec)


def exit_cause(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._procs: list[BaseProcess] = []
        self.overlaps_host_work = torch.cuda.is_available()

    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")
        for spec in self._specs(parent_pid=os.getpid()):
            p = ctx.Process(target=_entry, args=(self.config, spec), daemon=True,
                            name=f"conveyor-worker-{spec.rank}")
            p.start()
            self._procs.append(p)

    def _dead_workers(self) -> str | None:
        dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
        if not dead:
            return None
        self.failed_rank = dead[0]
        return f"worker process died: {', '.join(f'rank {i} ({exit_cause(self._procs[i].exitcode)})' for i in dead)}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def worker_process_ids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None and p.is_alive()]

    def _local_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self._procs) if p.pid is not None}

    def _stop_workers(self) -> None:
        # After a failure the survivors may sit in a collective with the dead
        # rank: no grace period, so recovery does not wait on them.
        grace = 0.0 if self._dead is not None else 5.0
        for p in self._procs:
            p.join(timeout=grace)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
