"""When to add or remove a data-parallel engine (serve.min_engines ..
serve.max_engines): a pure decision over one load snapshot and the clock.

The mechanism (conveyor/engine/dp/scaling.py) samples the engines every
serve.autoscale_interval_s and asks `ScalePolicy.decide`; the policy answers
the number of engines to have, which is the current one, one more or one
fewer. Signals, per engine in service:

- "waiting": requests queued in the engine, not scheduled. Up when the mean
  passes serve.target_waiting_per_engine; down when nothing waits and the
  running requests would fill at most DOWN_FILL of one engine fewer's batch
  slots (scheduler.max_num_seqs each).
- "kv_usage": the fraction of KV blocks in use. Up when the mean passes
  serve.target_kv_usage; down when the same blocks spread over one engine
  fewer would stay at most DOWN_FILL of that target.

Invariants: below min_engines or above max_engines the answer moves toward
the bound at once; otherwise a move is made only after the signal has asked
for it, without a break, for its whole delay (upscale_delay_s,
downscale_delay_s), and the clock of a direction restarts after each move
and whenever the signal stops asking. While an engine is being added,
removed or rebuilt (`busy`) nothing moves and both clocks restart. DOWN_FILL
< 1 keeps a scale-down from leaving a load that asks straight back up
(no flapping).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DOWN_FILL = 0.5
UP, HOLD, DOWN = 1, 0, -1


@dataclass(frozen=True)
class EngineLoad:
    waiting: int  # requests queued in the engine, not yet scheduled
    running: int  # requests in its batch
    kv_usage: float  # fraction of its KV blocks in use, 0..1
    capacity: int  # its batch slots (scheduler.max_num_seqs)


@dataclass(frozen=True)
class LoadSnapshot:
    engines: tuple[EngineLoad, ...]  # the engines in service
    busy: bool = False  # an engine is starting, draining or being rebuilt


@dataclass(frozen=True)
class ScaleSettings:
    min_engines: int
    max_engines: int
    signal: str = "waiting"  # "waiting" | "kv_usage"
    target_waiting: float = 2.0
    target_kv_usage: float = 0.8
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0

    @classmethod
    def from_config(cls, config: Any) -> ScaleSettings:
        """The serve section's knobs; an unset bound is the engines it starts with."""
        sv, dp = config.serve, config.parallel.data_parallel_size
        return cls(min_engines=dp if sv.min_engines is None else sv.min_engines,
                   max_engines=dp if sv.max_engines is None else sv.max_engines,
                   signal=sv.autoscale_signal, target_waiting=sv.target_waiting_per_engine,
                   target_kv_usage=sv.target_kv_usage, upscale_delay_s=sv.upscale_delay_s,
                   downscale_delay_s=sv.downscale_delay_s)

    @property
    def enabled(self) -> bool:
        return self.max_engines > self.min_engines


def wanted(s: ScaleSettings, engines: tuple[EngineLoad, ...]) -> int:
    """UP, DOWN or HOLD: what the signal asks of this load, within the bounds."""
    n = len(engines)
    if n == 0:
        return UP if s.min_engines > 0 else HOLD
    if s.signal == "kv_usage":
        used = sum(e.kv_usage for e in engines)
        up = used / n > s.target_kv_usage
        down = n > 1 and used / (n - 1) <= DOWN_FILL * s.target_kv_usage
    else:
        waiting = sum(e.waiting for e in engines)
        up = waiting / n > s.target_waiting
        fewer = sum(sorted(e.capacity for e in engines)[:n - 1])  # the smallest n-1 batches
        down = n > 1 and waiting == 0 and sum(e.running for e in engines) <= DOWN_FILL * fewer
    if up and n < s.max_engines:
        return UP
    if down and not up and n > s.min_engines:
        return DOWN
    return HOLD


class ScalePolicy:
    """The delays' clocks; `decide` is the whole policy."""

    def __init__(self, settings: ScaleSettings) -> None:
        self.settings = settings
        self._asking: int = HOLD  # the direction the signal has asked for since `_since`
        self._since: float = 0.0

    def decide(self, snap: LoadSnapshot, now: float) -> int:
        """The number of engines to have now (len(snap.engines), or one more or fewer)."""
        s, n = self.settings, len(snap.engines)
        if n < s.min_engines:
            return n + 1
        if n > s.max_engines:
            return n - 1
        if snap.busy:
            self._asking = HOLD
            return n
        want = wanted(s, snap.engines)
        if want != self._asking:
            self._asking, self._since = want, now
        if want == HOLD:
            return n
        delay = s.upscale_delay_s if want == UP else s.downscale_delay_s
        if now - self._since < delay:
            return n
        self._asking = HOLD  # the next move waits a whole delay again
        return n + want
