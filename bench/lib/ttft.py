"""TTFT per request from the offline frontend's own record (arrival -> first
token): `record_ttft()` patches RequestState.process once and returns the list it
appends to (callers clear it between measurements)."""
from __future__ import annotations

from typing import Any

TTFT: list[float] = []
_patched: list[bool] = []


def record_ttft() -> list[float]:
    if _patched:
        return TTFT
    from conveyor.engine.frontend import output_processor

    orig = output_processor.RequestState.process

    def process(self: Any, o: Any) -> bool:
        first = self.first_token_time is None and bool(o.new_token_ids)
        out = orig(self, o)
        if first:
            TTFT.append(self.first_token_time - self.arrival_time)
        return out

    output_processor.RequestState.process = process  # type: ignore[method-assign]
    _patched.append(True)
    return TTFT
