"""KV connectors, worker side, by the names of conveyor/engine/kv_connector/registry.py."""
from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo
from conveyor.engine.kv_connector.registry import connector_name
from conveyor.engine.kv_connector.spec import tier_spec
from conveyor.workers.kv_connector.base import KVConnectorWorker
from conveyor.workers.kv_connector.tiers import TierConnectorWorker

# (config, the output rank's KV layout, this rank's KV caches, this rank, world size)
WorkerFactory = Callable[[EngineConfig, KVCacheInfo, list[torch.Tensor], int, int], KVConnectorWorker]

WORKER_CONNECTORS: dict[str, WorkerFactory] = {
    "tiers": lambda config, kv, caches, rank, world: TierConnectorWorker(tier_spec(config, kv), caches,
                                                                       rank, world),
}


def make_worker_connector(config: EngineConfig, kv: KVCacheInfo, kv_caches: list[torch.Tensor],
                          rank: int = 0, world_size: int = 1) -> KVConnectorWorker | None:
    name = connector_name(config)
    return WORKER_CONNECTORS[name](config, kv, kv_caches, rank, world_size) if name is not None else None
