"""KV reuse and the KV tiers, cumulative, from the per-step SchedulerStats
(docs/kv_tiers.md). Names are DESIGN.md's Prometheus names as scraped
(a counter family NAME is exposed as NAME_total)."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.contracts import SchedulerStats

REUSED = "conveyor_kv_reused_tokens"
BYTES = "conveyor_kv_transfer_bytes"
FAILURES = "conveyor_kv_transfer_failures"
TIER_BLOCKS = "conveyor_kv_tier_blocks"  # a gauge: blocks held per tier


@dataclass
class KVTierCounters:
    reused: dict[str, int] = field(default_factory=dict)  # source -> prompt tokens not computed
    transfer_bytes: int = 0
    transfer_failures: int = 0
    tier_blocks: dict[str, int] = field(default_factory=dict)
    seen: bool = False  # an engine with a KV connector reported

    def absorb(self, st: SchedulerStats) -> None:
        if not (st.kv_reused_tokens or st.kv_tier_blocks or st.kv_transfer_bytes):
            return
        self.seen = True
        for source, n in st.kv_reused_tokens.items():
            self.reused[source] = self.reused.get(source, 0) + n
        self.transfer_bytes += st.kv_transfer_bytes
        self.transfer_failures += st.kv_transfer_failures
        if st.kv_tier_blocks:
            self.tier_blocks = dict(st.kv_tier_blocks)

    def as_dict(self) -> dict[str, float]:
        if not self.seen:
            return {}
        out = {f'{REUSED}_total{{source="{s}"}}': float(n) for s, n in sorted(self.reused.items())}
        out[f"{BYTES}_total"] = float(self.transfer_bytes)
        out[f"{FAILURES}_total"] = float(self.transfer_failures)
        out.update({f'{TIER_BLOCKS}{{tier="{t}"}}': float(n) for t, n in sorted(self.tier_blocks.items())})
        return out
