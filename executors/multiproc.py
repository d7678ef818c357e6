"""MultiprocExecutor: N worker processes on this machine without Ray
(torch.multiprocessing spawn, gloo on CPU / NCCL on CUDA, 127.0.0.1).

The test harness for tensor and pipeline parallelism; the RayExecutor runs
the very same worker loop inside Ray actors."""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from executors.distributed import DistributedExecutor
from executors.worker_proc import WorkerSpec, run_worker_loop


def _entry(config: EngineConfig, spec: WorkerSpec) -> None:
    run_worker_loop(config, spec)


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._procs: list[mp.Process] = []
        self.overlaps_host_work = torch.cuda.is_available()

    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")
        for spec in self._specs(parent_pid=os.getpid()):
            p = ctx.Process(target=_entry, args=(self.config, spec), daemon=True,
                            name=f"conveyor-worker-{spec.rank}")
            p.start()
            self._procs.append(p)

    def _dead_workers(self) -> str | None:
        dead = [f"rank {i} (exit code {p.exitcode})" for i, p in enumerate(self._procs) if not p.is_alive()]
        return f"worker process died: {', '.join(dead)}" if dead else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def worker_process_ids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None and p.is_alive()]

    def _stop_workers(self) -> None:
        for p in self._procs:
            p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
