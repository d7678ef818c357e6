"""One fake engine client for the data-parallel tests: a CoreClient without
an engine. It records adds, aborts, snapshot requests and the loss hooks a
fleet hands it; `emit(outs)` delivers outputs as its engine would."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest, KVCacheInfo
from conveyor.engine.errors import DeadFlag


class FakeEngineClient:
    started_ray = False
    admin = None

    def __init__(self, config: Any = None, block_size: int = 16, vocab_size: int = 256) -> None:
        self.config = config
        self.kv_info = KVCacheInfo(num_blocks=64, block_size=block_size, vocab_size=vocab_size)
        self.dead = DeadFlag()
        self.added: list[EngineCoreRequest] = []
        self.aborted: list[str] = []
        self.snapshots = 0
        self.closed = False
        self.emit: Callable[[EngineCoreOutputs], None] | None = None
        self.hooks: tuple[Callable[[str], None], Callable[[], None]] | None = None

    @property
    def added_ids(self) -> list[str]:
        return [r.request_id for r in self.added]

    def start(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        self.emit = on_outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        self.added += requests

    def request_kv_snapshot(self) -> None:
        self.snapshots += 1

    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None:
        self.hooks = (on_lost, on_back)

    def check_health(self) -> str:
        return "ok"

    def worker_pids(self) -> list[int]:
        return []

    def engine_pid(self) -> int | None:
        return None

    def shutdown(self) -> None:
        self.closed = True


def fake_fleet(config: Any, engines: list[FakeEngineClient],
               spawn: Callable[[Any], FakeEngineClient] = FakeEngineClient) -> Any:
    """A DataParallelClient over these fakes (spawn: what add/replace start)."""
    from conveyor.engine.dp.client import DataParallelClient
    from conveyor.engine.dp.fleet import Fleet, Slot

    return DataParallelClient(config, spawn=spawn, fleet=Fleet([Slot(e) for e in engines]))
