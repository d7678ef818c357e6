"""The boundary between a frontend and an EngineCore, and which client a config gets.

CoreClient is the protocol every client meets: InProcCoreClient (the core in
a thread of this process, conveyor/engine/core/inproc_client.py), RayCoreClient (the core in
an EngineCoreActor, conveyor/cluster/engine_actor/client.py) and DataParallelClient (N
engines behind the router, conveyor/engine/dp/client.py). SyncCoreEngine
(conveyor/engine/frontend/sync_engine.py) gives any of them the blocking face LLM steps.

Where the core runs is one knob, `parallel.engine_actor` (core_in_actor);
`parallel.executor` says only where the workers run. A core in an actor needs
a CoreClientFactory: the composition roots that know about Ray hand theirs in
(conveyor/cluster/: Serve, batch; a caller of LLM/AsyncLLM may too). Without one,
actor_client_factory() imports cluster's RayCoreClient: the only place conveyor/engine/
names conveyor/cluster/, reached only when the knob asks for an actor.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from conveyor.engine.errors import DeadFlag

OutputHandler = Callable[[EngineCoreOutputs], None]


class CoreClient(Protocol):
    kv_info: KVCacheInfo
    dead: DeadFlag  # the process's one "engine is dead" record (AsyncLLM shares it)

    def start(self, on_outputs: OutputHandler) -> None: ...
    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    # The frontend's answer to a ResumeCall from this client (conveyor/engine/contracts.py).
    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None: ...
    def check_health(self) -> str: ...  # "ok" | "recovering"; raises EngineDeadError
    def worker_pids(self) -> list[int]: ...
    def shutdown(self) -> None: ...


CoreClientFactory = Callable[[EngineConfig], CoreClient]


def core_in_actor(config: EngineConfig, serving: bool = False) -> bool:
    """Whether the EngineCore runs in its own Ray actor: parallel.engine_actor
    when set (YAML's older serve.engine_actor maps onto it at load). Unset: on
    with executor "ray" (that key's meaning before the knob existed) and in
    Serve replicas (`serving`), off for LLM/AsyncLLM with another executor."""
    p = config.parallel
    if p.engine_actor is not None:
        return p.engine_actor
    return p.executor == "ray" or serving


def actor_client_factory() -> CoreClientFactory:
    """The default factory of a core in a Ray actor, for LLM/AsyncLLM built
    without one. Imported here, on demand, so that conveyor/engine/ loads without
    conveyor/cluster/ (tests/cpu/test_contracts.py allows this one import)."""
    from conveyor.cluster.engine_actor.client import RayCoreClient

    return RayCoreClient.launch


def make_core_client(config: EngineConfig, actor_factory: CoreClientFactory | None = None) -> CoreClient:
    """The client of the config's engine; with parallel.data_parallel_size > 1,
    of its N engines behind the router (conveyor/engine/dp/client.py)."""
    if config.parallel.data_parallel_size > 1:
        from conveyor.engine.dp.client import DataParallelClient, make_engine_clients

        if core_in_actor(config):
            factory = actor_factory or actor_client_factory()
            return DataParallelClient(config, make_engine_clients(config, factory))
        return DataParallelClient(config)
    return make_single_core_client(config, actor_factory)


def make_single_core_client(config: EngineConfig,
                            actor_factory: CoreClientFactory | None = None) -> CoreClient:
    if core_in_actor(config):
        return (actor_factory or actor_client_factory())(config)
    from conveyor.engine.core.inproc_client import InProcCoreClient

    return InProcCoreClient(config)
