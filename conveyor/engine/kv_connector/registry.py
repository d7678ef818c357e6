"""The KV connectors an engine can run, by name (like conveyor/kernels/backends.py
for attention). The worker side registers the same names in
conveyor/workers/kv_connector/__init__.py; a test keeps the two in step."""
from __future__ import annotations

from collections.abc import Callable

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import KVCacheInfo
from conveyor.engine.kv_connector.base import KVConnectorScheduler
from conveyor.engine.kv_connector.spec import tier_spec, tiers_enabled
from conveyor.engine.kv_connector.tiers import TierConnectorScheduler

SchedulerFactory = Callable[[EngineConfig, KVCacheInfo], KVConnectorScheduler]

CONNECTORS: dict[str, SchedulerFactory] = {
    "tiers": lambda config, kv: TierConnectorScheduler(tier_spec(config, kv)),
}


def connector_name(config: EngineConfig) -> str | None:
    """The connector a config runs: the tiers when one is configured, else none."""
    return "tiers" if tiers_enabled(config) else None


def make_scheduler_connector(config: EngineConfig, kv: KVCacheInfo) -> KVConnectorScheduler | None:
    name = connector_name(config)
    return CONNECTORS[name](config, kv) if name is not None else None
