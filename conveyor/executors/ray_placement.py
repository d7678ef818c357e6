"""Pure placement arithmetic for the Ray executor (no Ray calls here, so every
rule is unit-tested without a cluster): how big a Ray instance the library
starts, what one worker's bundle holds, why a placement group cannot be
placed, and which GPUs each rank sees."""
from __future__ import annotations

import math

from conveyor.engine.config import EngineConfig


def local_ray_num_cpus(config: EngineConfig | None, cpu_count: int) -> int:
    """Logical CPUs of a Ray instance started for this engine: the machine's
    cores, or enough for the engine's CPU bundles when it asks for more (on
    CPU, ranks share cores; Ray's CPU count is only a scheduling budget)."""
    if config is None:
        return max(cpu_count, 1)
    need = math.ceil(config.world_size * config.parallel.data_parallel_size
                     * config.parallel.num_cpus_per_worker)
    return max(cpu_count, need, 1)


def worker_bundle(use_gpu: bool, num_cpus_per_worker: float) -> dict[str, float]:
    return {"GPU": 1.0} if use_gpu else {"CPU": float(num_cpus_per_worker)}


def host_and_worker_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """Executor "ray" under a host actor (a Serve replica, a batch actor):
    bundle 0 is the host (and its EngineCoreActor), bundles 1..world the
    workers, which RayExecutor finds in the current placement group."""
    worker = worker_bundle(use_gpu, config.parallel.num_cpus_per_worker)
    return [{"CPU": 1.0}] + [dict(worker) for _ in range(config.world_size)]


def missing_resources(bundles: list[dict[str, float]], available: dict[str, float]
                      ) -> dict[str, float]:
    """Per resource, how much the bundles need beyond what is available now
    (sums only: a non-empty answer means they cannot fit, an empty one that
    they might)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    return {k: v - available.get(k, 0.0) for k, v in need.items() if v > available.get(k, 0.0) + 1e-9}


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """Drop Ray's per-node and per-group bookkeeping keys."""
    return {k: v for k, v in sorted(resources.items())
            if not k.startswith("node:") and "_group_" not in k and k != "object_store_memory"
            and k != "memory"}


def placement_error(bundles: list[dict[str, float]], strategy: str, waited_s: float,
                    available: dict[str, float]) -> str:
    """What a placement group that did not get placed needs, misses and has."""
    missing = missing_resources(bundles, available)
    short = ", ".join(f"{v:g} {k}" for k, v in sorted(missing.items())) or \
        f"room on one node for the {strategy} strategy"
    return (f"placement group of {len(bundles)} x {bundles[0]} ({strategy}) not ready after "
            f"{waited_s:g}s (parallel.placement_timeout_s): missing {short}; available: "
            f"{_plain(available)}. Lower tensor/pipeline_parallel_size, set "
            f"parallel.num_cpus_per_worker below 1 on CPU, or add nodes")


def visible_devices(rank_nodes: list[str], rank_gpu_ids: list[list[str]]) -> list[tuple[str, int]]:
    """(CUDA_VISIBLE_DEVICES, local rank) per rank, in rank order.

    Every rank on a node sees all GPUs that the node's ranks hold, in rank
    (= bundle) order, so NCCL can use P2P/NVLink between them; its local rank
    is the position of its own GPU in that list. Ray alone would show each
    actor only its own GPU."""
    if len(rank_nodes) != len(rank_gpu_ids):
        raise ValueError(f"{len(rank_nodes)} nodes for {len(rank_gpu_ids)} GPU id lists")
    per_node: dict[str, list[str]] = {}
    for node, ids in zip(rank_nodes, rank_gpu_ids):
        if len(ids) != 1:
            raise RuntimeError(f"a GPU worker must hold exactly one GPU, got ids {ids}")
        per_node.setdefault(node, []).append(str(ids[0]))
    out = []
    for node, ids in zip(rank_nodes, rank_gpu_ids):
        devices = per_node[node]
        if len(set(devices)) != len(devices):
            raise RuntimeError(f"two ranks on node {node} got the same GPU: {devices}")
        out.append((",".join(devices), devices.index(str(ids[0]))))
    return out


def rank_devices(rank_nodes: list[str], rank_gpu_ids: list[list[str]] | None
                 ) -> tuple[list[int], list[dict[str, str]]]:
    """(local rank, extra env) per rank, from each rank's node and, on GPU,
    its GPU ids (None on CPU: the local rank counts the node's earlier ranks)."""
    if rank_gpu_ids is None:
        return [rank_nodes[:r].count(n) for r, n in enumerate(rank_nodes)], [{} for _ in rank_nodes]
    devices = visible_devices(rank_nodes, rank_gpu_ids)
    return [lr for _, lr in devices], [{"CUDA_VISIBLE_DEVICES": v} for v, _ in devices]
