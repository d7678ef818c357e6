"""SyncCoreEngine: the EngineCore-shaped face of any CoreClient, for the
blocking LLM class (its step_fn waits for the client's next outputs)."""
from __future__ import annotations

import queue

from conveyor.engine.contracts import EngineCoreOutputs, EngineCoreRequest
from conveyor.engine.core_client import CoreClient
from conveyor.engine.errors import EngineDeadError


class SyncCoreEngine:
    """The EngineCore-shaped face of a CoreClient, for the blocking LLM class:
    step_fn() waits for the next outputs; an engine error raises."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.kv_info = client.kv_info
        self._outputs: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self._live: set[str] = set()
        client.start(self._outputs.put)

    def add_request(self, request: EngineCoreRequest) -> None:
        # Checked by LLM's frontend; the remote core guards what it can schedule.
        self._live.add(request.request_id)
        self.client.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._live.difference_update(request_ids)
        self.client.abort_requests(request_ids)

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        """LLM's answer to a ResumeCall (the requests stay live)."""
        try:
            self.client.resume(tag, requests)
        except EngineDeadError:
            pass  # the engine's own error message comes next: step_fn raises it

    def has_work(self) -> bool:
        return bool(self._live)

    def worker_pids(self) -> list[int]:
        return self.client.worker_pids()

    def step_fn(self) -> tuple[EngineCoreOutputs, bool]:
        outs = self._outputs.get()
        if outs.engine_error is not None:
            self._live.clear()
            raise EngineDeadError(outs.engine_error)
        for o in outs.outputs:
            if o.finished:
                self._live.discard(o.request_id)
        return outs, True

    def shutdown(self) -> None:
        self.client.shutdown()

