"""Cumulative speculative-decoding counters, from the per-step SchedulerStats
(vLLM's metric names under the conveyor: prefix)."""
from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.engine.contracts import SchedulerStats, add_per_index

NUM_DRAFTS = "conveyor:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "conveyor:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "conveyor:spec_decode_num_accepted_tokens"
PER_POS = "conveyor:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def absorb(self, st: SchedulerStats) -> None:
        self.num_drafts += st.spec_num_drafts
        self.num_draft_tokens += st.spec_num_draft_tokens
        self.num_accepted_tokens += st.spec_num_accepted_tokens
        add_per_index(self.accepted_per_pos, st.spec_accepted_per_pos)

    def as_dict(self) -> dict[str, float]:
        """Counter values keyed by metric name; per position as NAME{position="i"}."""
        out = {NUM_DRAFTS: float(self.num_drafts), NUM_DRAFT_TOKENS: float(self.num_draft_tokens),
               NUM_ACCEPTED: float(self.num_accepted_tokens)}
        for i, n in enumerate(self.accepted_per_pos):
            out[f'{PER_POS}{{position="{i}"}}'] = float(n)
        return out
