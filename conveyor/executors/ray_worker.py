"""The Ray actor that hosts one worker rank: it runs the same busy loop as a
spawned process (conveyor/executors/worker_proc.py); Ray only places and supervises it."""
from __future__ import annotations

import os

import msgspec
import ray

from conveyor.engine.config import EngineConfig
from conveyor.parallel.ports import free_port


@ray.remote(max_concurrency=2)  # type: ignore[call-overload]  # ray's stubs omit actor options
class RayWorkerActor:
    def node_info(self) -> tuple[str, str, int]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    def free_port(self) -> int:
        return free_port("")  # on this actor's node, reachable from the others

    def run(self, config_bytes: bytes, spec_bytes: bytes, env: dict[str, str] | None = None) -> None:
        # Before anything touches CUDA: CUDA_VISIBLE_DEVICES is read once.
        os.environ.update(env or {})
        from conveyor.executors.worker_proc import WorkerSpec, run_worker_loop

        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        run_worker_loop(config, msgspec.msgpack.decode(spec_bytes, type=WorkerSpec))
