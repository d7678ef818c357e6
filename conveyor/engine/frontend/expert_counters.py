"""Mixtures of experts: tokens routed to each expert, cumulative, from the
per-step SchedulerStats (summed over the MoE layers of the replying stage).
Users balance expert placement from it (docs/moe.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.contracts import SchedulerStats, add_per_index

ROUTED = "conveyor:moe_routed_tokens"


@dataclass
class ExpertCounters:
    routed: list[int] = field(default_factory=list)

    def absorb(self, st: SchedulerStats) -> None:
        add_per_index(self.routed, st.moe_routed_tokens)

    def as_dict(self) -> dict[str, float]:
        """Counter values keyed as NAME{expert="i"}."""
        return {f'{ROUTED}{{expert="{i}"}}': float(n) for i, n in enumerate(self.routed)}
