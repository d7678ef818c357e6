"""Parts of SchedulerStats that subsystems own: taken (reset) at each stats message."""
from __future__ import annotations

from collections import Counter
from typing import Any

from conveyor.engine.core.remote_kv import RemoteKVWaits
from conveyor.engine.kv_connector.base import KVConnectorScheduler
from conveyor.engine.structured_output.manager import StructuredOutputManager


def structured_stats(mgr: StructuredOutputManager | None) -> dict[str, Any]:
    if mgr is None:
        return {}
    bitmask_ms, bitmask_rows = mgr.take_bitmask_since_last()
    return dict(num_structured_requests=mgr.stats.num_requests,
                grammar_compile_ms=mgr.take_compile_ms(), bitmask_ms=bitmask_ms,
                bitmask_rows=bitmask_rows)


def kv_stats(connector: KVConnectorScheduler | None, remote_kv: RemoteKVWaits | None,
             reused: Counter[str]) -> dict[str, Any]:
    """Tokens reused per source (the caller's counter, emptied), tier transfers,
    failures (load deadlines included) and occupancy."""
    if connector is None:
        return {}
    out: dict[str, Any] = dict(kv_reused_tokens=dict(reused))
    reused.clear()
    ts = connector.take_stats()
    timeouts = remote_kv.take_timeouts() if remote_kv is not None else 0
    if ts is not None:
        out.update(kv_transfer_bytes=ts.transfer_bytes, kv_transfer_failures=ts.transfer_failures + timeouts,
                   kv_tier_blocks=ts.tier_blocks)
    return out
