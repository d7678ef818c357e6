"""RayExecutor: workers are Ray actors in one placement group per engine.

Ray is used for placement and lifecycle only. The per-step SchedulerOutput
goes over the CURVE-encrypted ZMQ data plane of DistributedExecutor, never as a Ray
call per worker per step. Rank order: bundles on the driver's node first,
then node by node, so each TP group (consecutive ranks) stays on one node.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conveyor.engine.config import EngineConfig
from conveyor.executors.distributed import DistributedExecutor
from conveyor.executors.ray_placement import local_ray_num_cpus, placement_error, rank_devices, worker_bundle
from conveyor.executors.ray_worker import RayWorkerActor

log = logging.getLogger(__name__)
_ENV_PREFIXES = ("CONVEYOR_", "NCCL_", "GLOO_", "TRITON_", "OMP_", "HF_", "TRANSFORMERS_")


def ensure_ray(config: EngineConfig | None = None) -> bool:
    """Connect to (or start) Ray; True if this call started a local instance,
    sized so that the engine of `config` fits on it."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False)
        return False
    ray.init(address="local", num_cpus=local_ray_num_cpus(config, os.cpu_count() or 1),
             include_dashboard=False)
    return True


def cluster_host() -> str:
    """Where to bind data-plane sockets: loopback on a one-node cluster, else
    this node's cluster-internal address."""
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    return "127.0.0.1" if alive <= 1 else ray.util.get_node_ip_address()


def _use_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def order_bundles(bundle_nodes: list[str], driver_node: str) -> list[int]:
    """Bundle indices in rank order: the driver's node first, then by node."""
    nodes = sorted(set(bundle_nodes), key=lambda n: (n != driver_node, n))
    return [i for n in nodes for i, bn in enumerate(bundle_nodes) if bn == n]


def check_tp_locality(order: list[int], bundle_nodes: list[str], tp: int) -> None:
    for start in range(0, len(order), tp):
        group = {bundle_nodes[i] for i in order[start:start + tp]}
        if len(group) > 1:
            raise RuntimeError(f"tensor-parallel group of ranks {start}..{start + tp - 1} spans "
                               f"{len(group)} nodes; give each node a multiple of {tp} bundles")


def place_workers(pg: PlacementGroup, first: int, world: int, tp: int, start_timeout_s: float
                  ) -> tuple[list[Any], list[str], list[int], list[tuple[str, str, int]]]:
    """One worker actor per bundle first..first+world-1, returned in rank
    order with (bundle nodes, rank order, per-rank (node, ip, pid))."""
    bundle = pg.bundle_specs[first]
    gpus = bundle.get("GPU", 0)
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    actors = [RayWorkerActor.options(  # type: ignore[attr-defined]  # added by @ray.remote
        num_cpus=0 if gpus else bundle.get("CPU", 1), num_gpus=gpus,
        runtime_env={"env_vars": env},
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + i),
    ).remote() for i in range(world)]
    infos = ray.get([a.node_info.remote() for a in actors], timeout=start_timeout_s)
    nodes = [n for n, _, _ in infos]
    order = order_bundles(nodes, ray.get_runtime_context().get_node_id())
    check_tp_locality(order, nodes, tp)
    return [actors[i] for i in order], nodes, order, [infos[i] for i in order]


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig, pg: PlacementGroup | None = None,
                 worker_class: str = "conveyor.workers.worker:Worker") -> None:
        ensure_ray(config)
        super().__init__(config, host=cluster_host(), worker_class=worker_class)
        self._pg = pg
        self._own_pg = False
        self._actors: list[Any] = []
        self._run_refs: list[Any] = []
        self.bundle_nodes: list[str] = []
        self.rank_order: list[int] = []
        self.rank_infos: list[tuple[str, str, int]] = []  # (node id, ip, pid) per rank

    # ---- placement ------------------------------------------------------------------

    def _placement_group(self) -> tuple[PlacementGroup, int]:
        """(placement group, index of its first worker bundle)."""
        if self._pg is not None:
            return self._pg, 0
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= self.world_size + 1:
            return current, 1  # a Serve replica: bundle 0 is the replica's own
        p = self.config.parallel
        bundles = [worker_bundle(_use_gpus(), p.num_cpus_per_worker) for _ in range(self.world_size)]
        pg = placement_group(bundles, strategy=p.placement_strategy)
        self._own_pg = True
        try:
            ray.get(pg.ready(), timeout=p.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(placement_error(bundles, p.placement_strategy, p.placement_timeout_s,
                                               ray.available_resources())) from None
        return pg, 0

    def _start_workers(self) -> None:
        pg, first = self._placement_group()
        self._pg = pg
        gpus = pg.bundle_specs[first].get("GPU", 0)
        p = self.config.parallel
        placed = place_workers(pg, first, self.world_size, p.tensor_parallel_size, p.worker_start_timeout_s)
        self._actors, self.bundle_nodes, self.rank_order, infos = placed
        port = ray.get(self._actors[0].free_port.remote())
        host = "127.0.0.1" if self._host_is_local() else infos[0][1]
        self.overlaps_host_work = gpus > 0
        local_ranks, envs = self._devices(gpus > 0)
        specs = self._specs(f"tcp://{host}:{port}", local_ranks)
        cfg = msgspec.msgpack.encode(self.config)
        self.worker_pids = [pid for _, _, pid in infos]
        self.rank_infos = infos
        self._run_refs = [a.run.remote(cfg, msgspec.msgpack.encode(s), env)
                          for a, s, env in zip(self._actors, specs, envs)]

    def owned_placement_group_id(self) -> str | None:
        """Hex id of the placement group this executor made (None: it runs in
        its caller's). Ray frees a group made by an actor only when the job
        ends, so whoever replaces a dead engine actor removes it."""
        return self._pg.id.hex() if self._own_pg and self._pg is not None else None

    def worker_process_ids(self) -> list[int]:
        return list(self.worker_pids)

    def rank_location(self, rank: int) -> str:
        if rank >= len(self.rank_infos):
            return "an unknown node"
        node, ip, pid = self.rank_infos[rank]
        return f"node {node[:12]} ({ip}), pid {pid}"

    def _local_pids(self) -> dict[int, int]:
        here = ray.get_runtime_context().get_node_id()
        return {r: pid for r, (node, _, pid) in enumerate(self.rank_infos) if node == here}

    def _host_is_local(self) -> bool:
        return self._replies.address.startswith("tcp://127.0.0.1")

    def _devices(self, gpus: bool) -> tuple[list[int], list[dict[str, str]]]:
        """(local rank, extra env) per rank. On GPU every rank sees all GPUs
        of its node's ranks (Ray alone shows each actor only its own)."""
        nodes = [self.bundle_nodes[i] for i in self.rank_order]
        ids = ray.get([a.gpu_ids.remote() for a in self._actors],
                      timeout=self.config.parallel.worker_start_timeout_s) if gpus else None
        return rank_devices(nodes, ids)

    # ---- supervision -----------------------------------------------------------------

    def _dead_workers(self) -> str | None:
        if not self._run_refs:
            return None
        done, _ = ray.wait(self._run_refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._run_refs.index(done[0])
        self.failed_rank = rank
        try:
            ray.get(done[0])
            why = "exited"
        except Exception as e:  # noqa: BLE001 - any failure is a dead worker
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return f"worker actor of rank {rank} died ({why})"

    def _stop_workers(self) -> None:
        if self._run_refs and self._dead is None:  # after a failure: no grace (see multiproc)
            ray.wait(self._run_refs, num_returns=len(self._run_refs), timeout=5)
        for a in self._actors:
            ray.kill(a, no_restart=True)
        self._actors, self._run_refs = [], []
        if self._own_pg and self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
