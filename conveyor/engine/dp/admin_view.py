"""What the data-parallel client shows about its engines: the admin view
(`/admin/engines`) and the per-engine metric series."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.engine.core_client import MetricRow
from conveyor.engine.dp.fleet import EngineState, Fleet
from conveyor.engine.dp.migration_log import MigrationLog
from conveyor.engine.dp.router.policy import Router


def engine_rows(fleet: Fleet, role: Callable[[int], str] | None,
                legs: Callable[[int], int] | None = None) -> list[dict[str, Any]]:
    """Each engine's slot, state, role (prefill / decode with P/D, else both),
    load (and with P/D its prefill legs in flight, counted as they are sent)
    and process ids."""
    out: list[dict[str, Any]] = []
    for i, slot in enumerate(list(fleet.slots)):
        st = slot.stats
        info: dict[str, Any] = {
            "engine": i, "incarnation": slot.incarnation, "state": slot.state.value,
            "role": role(i) if role is not None else "both",
            "kv_cache_usage": st.kv_cache_usage if st is not None else 0.0,
            "requests": st.num_running_reqs + st.num_waiting_reqs if st is not None else 0}
        if legs is not None:
            info["prefill_legs"] = legs(i)
        if slot.state in (EngineState.UP, EngineState.DRAINED):
            try:
                info["worker_pids"] = slot.client.worker_pids()
                pid = slot.client.engine_pid()
            except Exception as e:  # noqa: BLE001 - a dead actor not yet noticed: the view still answers
                info["unreachable"] = f"{type(e).__name__}: {str(e)[:200]}"
                pid = None
            if pid is not None:
                info["actor_pid"] = pid
        out.append(info)
    return out


def fleet_metric_rows(fleet: Fleet, router: Router, migrations: MigrationLog) -> list[MetricRow]:
    """Per-engine series, each with an `engine` label: prefix-cache queries
    and hits in tokens, prompt tokens computed (not reused from any cache),
    the router's decisions by policy and reason, its index size in blocks,
    migrations off each engine by cause, and tokens each engine prefilled
    again for requests migrated to it (conveyor/engine/dp/migration_log.py)."""
    rows: list[MetricRow] = []
    for e, slot in enumerate(fleet.slots):
        lab = {"engine": str(e)}
        computed = slot.stats.num_prompt_tokens_computed if slot.stats is not None else 0
        rows += [("prefix_cache_queries", "counter", lab, slot.prefix_queries),
                 ("prefix_cache_hits", "counter", lab, slot.prefix_hits),
                 ("prompt_tokens_computed", "counter", lab, computed),
                 ("router_index_blocks", "gauge", lab, router.index_size(e))]
    for (policy, reason, e), n in sorted(router.decisions.items()):
        rows.append(("router_decisions", "counter", {"engine": str(e), "policy": policy, "reason": reason}, n))
    rows += migrations.rows()
    return rows
