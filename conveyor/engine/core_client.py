"""The boundary between a frontend and an EngineCore: the CoreClient protocol,
and FleetAdmin, what a client of several engines adds. A leaf: it imports
only contracts, config and errors; which client a config gets is
conveyor/engine/frontend/clients.py's business.

Clients: InProcCoreClient (the core in a thread of this process,
conveyor/engine/core/inproc_client.py), RayCoreClient (the core in an
EngineCoreActor, conveyor/cluster/engine_actor/client.py) and
DataParallelClient (N engines behind the router, conveyor/engine/dp/client.py).
SyncCoreEngine (conveyor/engine/frontend/sync_engine.py) gives any of them the
blocking face LLM steps.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from conveyor.engine.errors import DeadFlag

OutputHandler = Callable[[EngineCoreOutputs], None]
# A Prometheus series: (name, "counter" | "gauge", labels, value).
MetricRow = tuple[str, str, dict[str, str], float]
# What every admin entry point answers a client of one engine (`admin` is None).
NOT_DATA_PARALLEL = "this server has one engine: it needs parallel.data_parallel_size > 1"


def metric_dict(rows: list[MetricRow]) -> dict[str, float]:
    """Rows keyed by their Prometheus names (LLM.get_metrics)."""
    out: dict[str, float] = {}
    for name, kind, lab, v in rows:
        labels = ",".join(f'{k}="{x}"' for k, x in lab.items())
        out[f"conveyor:{name}{'_total' if kind == 'counter' else ''}{{{labels}}}"] = v
    return out


class FleetAdmin(Protocol):
    """The operations over a client's engines (data parallel): what the admin
    routes, LLM.drain and `conveyor drain` call. Engine indices are slots that
    are never renumbered. ValueError: a request the fleet cannot honour (the
    message says why); TimeoutError: a drain that did not finish in time."""

    def drain(self, engine: int, timeout_s: float = 60.0) -> int: ...
    def undrain(self, engine: int) -> None: ...
    def replace_engine(self, engine: int, config: EngineConfig | None = None, timeout_s: float = 60.0) -> int: ...
    def scale_to(self, engines: int, timeout_s: float = 60.0) -> int: ...
    def reload(self, config: EngineConfig | None = None, timeout_s: float = 60.0) -> dict[str, Any]: ...
    def engines(self) -> list[dict[str, Any]]: ...
    def engine_count(self) -> int: ...
    def metric_rows(self) -> list[MetricRow]: ...


class CoreClient(Protocol):
    kv_info: KVCacheInfo
    dead: DeadFlag  # the process's one "engine is dead" record (AsyncLLM shares it)
    started_ray: bool  # shutdown() ends the Ray instance this client started

    @property
    def admin(self) -> FleetAdmin | None:
        """The fleet's operations, None for a client of one engine."""
        ...

    def start(self, on_outputs: OutputHandler) -> None: ...
    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    # The frontend's answer to a ResumeCall from this client (conveyor/engine/contracts.py).
    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None: ...
    def request_kv_snapshot(self) -> None: ...
    # A client whose engine can be lost and rebuilt (an actor) reports it, so
    # that a fleet moves its requests instead of letting them wait; others never call.
    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None: ...
    def check_health(self) -> str: ...  # "ok" | "recovering"; raises EngineDeadError
    def worker_pids(self) -> list[int]: ...
    def engine_pid(self) -> int | None: ...  # the core's own process when it has one (an actor)
    def shutdown(self) -> None: ...


CoreClientFactory = Callable[[EngineConfig], CoreClient]
