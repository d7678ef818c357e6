"""Which CoreClient a config gets (the composition root of LLM and AsyncLLM).

Where the core runs is one knob, `parallel.engine_actor` (EngineConfig.
core_in_actor); `parallel.executor` says only where the workers run. A core in
an actor needs a CoreClientFactory: the composition roots that know about Ray
hand theirs in (conveyor/cluster/: Serve, batch; a caller of LLM/AsyncLLM may
too). Without one, actor_client_factory() imports cluster's RayCoreClient:
the only place conveyor/engine/ names conveyor/cluster/, reached only when the
knob asks for an actor (tests/cpu/unit/test_contracts.py allows this one import).
"""
from __future__ import annotations

from conveyor.engine.config import EngineConfig
from conveyor.engine.core_client import CoreClient, CoreClientFactory


def actor_client_factory() -> CoreClientFactory:
    """The default factory of a core in a Ray actor, for LLM/AsyncLLM built without one."""
    from conveyor.cluster.engine_actor.client import RayCoreClient

    return RayCoreClient.launch


def make_core_client(config: EngineConfig, actor_factory: CoreClientFactory | None = None) -> CoreClient:
    """The client of the config's engine; with parallel.data_parallel_size > 1,
    of its N engines behind the router (conveyor/engine/dp/client.py)."""
    if config.parallel.data_parallel_size > 1:
        from conveyor.engine.dp.client import DataParallelClient

        if config.core_in_actor():
            return DataParallelClient(config, spawn=actor_factory or actor_client_factory())
        return DataParallelClient(config, spawn=in_process_engine)
    return make_single_core_client(config, actor_factory)


def make_single_core_client(config: EngineConfig,
                            actor_factory: CoreClientFactory | None = None) -> CoreClient:
    if config.core_in_actor():
        return (actor_factory or actor_client_factory())(config)
    from conveyor.engine.core.inproc_client import InProcCoreClient

    return InProcCoreClient(config)


def in_process_engine(config: EngineConfig) -> CoreClient:
    """One engine of a data-parallel client in this process (conveyor/engine/dp/fleet.py
    engine_config: its workers in a process of their own)."""
    from conveyor.engine.dp.fleet import engine_config

    return make_single_core_client(engine_config(config))
