"""What the data-parallel client records about migrations (conveyor/engine/dp/client.py).

A request migrates when its engine is lost (its core died, its restart budget
is spent, its actor is being rebuilt) or drained: the client resubmits it to
another engine with the tokens already delivered. MigrationLog counts those
moves per cause and engine, the tokens the new engine had to prefill again
(the migrated context minus what its prefix cache held, known from the new
engine's first output), and per moved stream the largest gap between two
deliveries from the last token before the move until the stream ends; that
gap is logged at info level with both engine ids when the stream ends.

Not thread-safe by itself: the client calls it under its own lock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from conveyor.engine.contracts import EngineCoreOutput

log = logging.getLogger(__name__)

CAUSES = ("lost", "drain")


@dataclass
class _Move:
    src: int
    dst: int
    cause: str
    context_tokens: int  # prompt + delivered tokens the new engine computes again
    last_token_at: float  # the last delivery before the move (or the move itself)
    max_gap_s: float = 0.0
    cached_tokens: int | None = None  # on dst, from its first output


@dataclass
class MigrationLog:
    num_engines: int
    # (source engine, cause) -> requests moved off it
    moved: dict[tuple[int, str], int] = field(default_factory=dict)
    # destination engine -> tokens it prefilled again for migrated requests
    reprefilled: dict[int, int] = field(default_factory=dict)
    longest_context: int = 0  # the longest context any move sent (bench/migration.py's bound)
    _live: dict[str, _Move] = field(default_factory=dict)

    def record(self, request_id: str, src: int, dst: int, cause: str, context_tokens: int,
               last_token_at: float) -> None:
        key = (src, cause)
        self.moved[key] = self.moved.get(key, 0) + 1
        self.longest_context = max(self.longest_context, context_tokens)
        prev = self._live.get(request_id)
        gap = prev.max_gap_s if prev is not None else 0.0
        self._live[request_id] = _Move(src, dst, cause, context_tokens, last_token_at, gap)

    def observe(self, engine: int, outputs: list[EngineCoreOutput], now: float) -> None:
        """Outputs of `engine` about to be delivered to the frontend."""
        if not self._live:
            return
        for o in outputs:
            m = self._live.get(o.request_id)
            if m is None or m.dst != engine:
                continue
            if m.cached_tokens is None:
                m.cached_tokens = min(o.num_cached_tokens, m.context_tokens)
                self.reprefilled[engine] = (self.reprefilled.get(engine, 0)
                                            + m.context_tokens - m.cached_tokens)
            if o.new_token_ids or o.finished:
                m.max_gap_s = max(m.max_gap_s, now - m.last_token_at)
                m.last_token_at = now
            if o.finished:
                self.end(o.request_id)

    def end(self, request_id: str) -> None:
        """The stream ended (finished or aborted): log its move."""
        m = self._live.pop(request_id, None)
        if m is None:
            return
        log.info("request %s migrated from engine %d to engine %d (%s): largest gap between tokens "
                 "%.1f ms, %d context tokens, %s cached on the new engine", request_id, m.src, m.dst,
                 m.cause, m.max_gap_s * 1e3, m.context_tokens,
                 "?" if m.cached_tokens is None else m.cached_tokens)

    def rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        """Prometheus rows (name, kind, labels, value), every engine and cause
        present from the start (a counter that appears late reads as a reset)."""
        out: list[tuple[str, str, dict[str, str], float]] = []
        for e in range(self.num_engines):
            for cause in CAUSES:
                out.append(("migrations", "counter", {"engine": str(e), "cause": cause},
                            self.moved.get((e, cause), 0)))
            out.append(("migration_reprefill_tokens", "counter", {"engine": str(e)},
                        self.reprefilled.get(e, 0)))
        return out
