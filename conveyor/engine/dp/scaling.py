"""Engines added and removed while serving (conveyor/engine/dp/client.py's mixin):
autoscaling between serve.min_engines and serve.max_engines, and a rollout
of a changed config, all without losing a request.

- `add_engine` starts one more engine (its own core and worker group, or
  EngineCoreActor, from the client's spawn function) into a free slot, or a
  new one (the router gets one more engine), and routes to it once it runs.
- `remove_engine` drains an engine through migration (its requests continue
  on the others, token-exact) and then shuts it down; its slot stays empty
  ("off") until an add reuses it.
- `rollout` replaces the engines one at a time with the new config; the last
  engine up is never drained onto nothing: a new engine starts first.
- `reload` checks a changed config (conveyor/engine/dp/reload_plan.py) and does the above.
- `Autoscaler` samples the engines' load every serve.autoscale_interval_s
  and applies `ScalePolicy` (conveyor/engine/dp/scale_policy.py).

Invariants: one scale operation at a time (`_scale_lock`, re-entrant: a
rollout adds and removes); the autoscaler never waits for it (it skips a
look). Slots are never renumbered: an engine's index names it in metrics and
admin routes for its whole life. Engine states are changed under the
client's `_lock` only, and lists grow under it in the order unlocked
readers index them (states before clients).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.dp.reload_plan import plan_reload
from conveyor.engine.dp.scale_policy import EngineLoad, LoadSnapshot, ScalePolicy, ScaleSettings
from conveyor.engine.errors import EngineDeadError

log = logging.getLogger(__name__)
UP, LOST, DEAD = "up", "lost", "dead"  # == conveyor/engine/dp/client.py's states
OFF = "off"  # how engines() shows a slot emptied by a scale-down
SHUTDOWN_WAIT_S = 120.0  # the longest shutdown waits for an engine being started or drained


class _Vacant:
    """The client of an emptied slot: holds nothing, does nothing."""

    def start(self, on_outputs: Any) -> None:
        pass

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def request_kv_snapshot(self) -> None:
        pass

    def check_health(self) -> str:
        raise EngineDeadError("engine slot is empty")

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass


def owns_ray(client: Any) -> bool:
    """The client that started the Ray instance: it shuts down last."""
    return bool(getattr(client, "started_ray", False))


class EngineScaling:
    """Mixin of DataParallelClient (uses its _lock, states, clients, router,
    _spawn, _stats, _live, drain and _install's bookkeeping)."""

    # False where the engines are not this client's to start or stop (the
    # engine pool of several ingress replicas, conveyor/cluster/engine_pool.py).
    can_scale = True

    def _check_can_scale(self: Any) -> None:
        if not self.can_scale:
            raise ValueError("these engines belong to the app's engine pool (serve.replicas > 1): they are "
                             "not added, removed or rolled out from one replica")

    def _init_scaling(self: Any) -> None:
        self._removed: set[int] = set()
        self._scale_lock = threading.RLock()
        # Where reload() reads the config again (set by whoever loaded it: the Serve replica).
        self.config_source: Callable[[], EngineConfig] | None = None
        self.autoscaler: Autoscaler | None = None
        self._set_autoscaling(self.config)

    def _set_autoscaling(self: Any, config: EngineConfig) -> None:
        settings = ScaleSettings.from_config(config)
        if self.autoscaler is not None:
            self.autoscaler.stop()
            self.autoscaler = None
        if settings.enabled:
            self.autoscaler = Autoscaler(self, settings, config.serve.autoscale_interval_s)

    def _stop_scaling(self: Any) -> None:
        """Before shutdown: no more looks, and a scale operation under way
        finishes first (an engine it starts must not outlive the client)."""
        if getattr(self, "autoscaler", None) is not None:
            self.autoscaler.stop()
        lock = getattr(self, "_scale_lock", None)
        if lock is not None and lock.acquire(timeout=SHUTDOWN_WAIT_S):
            lock.release()

    def slot_state(self: Any, i: int) -> str:
        return OFF if i in self._removed else self.states[i]

    def engine_count(self: Any) -> int:
        """Engines in service or coming back (up or lost)."""
        return sum(s in (UP, LOST) for s in self.states)

    def load_snapshot(self: Any) -> LoadSnapshot:
        """The up engines' last reported load; busy while one is being rebuilt."""
        cap = self.config.scheduler.max_num_seqs
        with self._lock:
            loads = tuple(EngineLoad(st.num_waiting_reqs, st.num_running_reqs, st.kv_cache_usage, cap)
                          if st is not None else EngineLoad(0, 0, 0.0, cap)
                          for i, st in enumerate(self._stats) if self.states[i] == UP)
            return LoadSnapshot(loads, busy=LOST in self.states)

    # ---- the mechanism -------------------------------------------------------------

    def add_engine(self: Any, config: EngineConfig | None = None) -> int:
        """Start one more engine (of `config`, default the client's) and
        route to it once it runs; returns its slot."""
        self._check_can_scale()
        with self._scale_lock:
            new = self._spawn(config if config is not None else self.config)
            with self._lock:
                free = sorted(self._removed)
                slot = free[0] if free else self._grow()
            self._install(slot, new)
        log.info("engine %d added (%d engines up)", slot, self.engine_count())
        return slot

    def _grow(self: Any) -> int:
        """One more slot, dead until installed (under _lock)."""
        slot = self.router.add_engine()
        self.states.append(DEAD)
        self._prefix.append([0, 0])
        self._stats.append(None)
        self.migrations.num_engines = slot + 1
        self.clients.append(_Vacant())
        return slot

    def _install(self: Any, slot: int, new: Any) -> None:
        """Put a started client in `slot` and route to it; requests that
        waited for an engine (every one was lost) go on now."""
        with self._lock:
            self.clients[slot] = new
            self._removed.discard(slot)
            self._prefix[slot], self._stats[slot] = [0, 0], None
            self._hook(slot, new)
            if self._on_outputs is not None:
                new.start(self._sink(slot, self._on_outputs))
            self.states[slot] = UP
            self.router.engine_up(slot)
            self._resume_waiting()

    def remove_engine(self: Any, engine: int | None = None, timeout_s: float = 60.0) -> int:
        """Drain `engine` (default: the up engine holding the fewest
        requests) through migration, then shut it down; returns how many
        requests moved. ValueError when it is the only engine up."""
        self._check_can_scale()
        with self._scale_lock:
            if engine is None:
                engine = self._victim()
            elif not 0 <= engine < len(self.clients) or engine in self._removed:
                raise ValueError(f"engine {engine} is not an engine in service")
            # A dead engine (restart budget spent) holds nothing: only its slot is emptied.
            moved = 0 if self.states[engine] == DEAD else self.drain(engine, timeout_s)
            with self._lock:
                self.states[engine] = DEAD  # late outputs of the old one are dropped from here on
                self._removed.add(engine)
                old, self.clients[engine] = self.clients[engine], _Vacant()
            self._let_go(old)
        log.info("engine %d removed (%d requests moved off it; %d engines up)", engine, moved,
                 self.engine_count())
        return moved

    def _victim(self: Any) -> int:
        with self._lock:
            held = {i: 0 for i, s in enumerate(self.states) if s == UP}
            for e in self._live.values():
                if e in held:
                    held[e] += 1
        if len(held) < 2:
            raise ValueError("one engine is up: no engine to take its requests")
        # Fewest requests to move; the Ray owner last (it must outlive the others); then the newest.
        return min(held, key=lambda i: (owns_ray(self.clients[i]), held[i], -i))

    def _let_go(self: Any, old: Any) -> None:
        """Shut a replaced or removed client down; if it started Ray, an up
        engine's client takes that over first (Ray goes down with the last)."""
        if owns_ray(old):
            heir = next((c for i, c in enumerate(self.clients) if self.states[i] == UP), None)
            if heir is not None:
                old.started_ray, heir.started_ray = False, True
        old.shutdown()

    def scale_to(self: Any, engines: int, timeout_s: float = 60.0) -> int:
        """Add or remove engines until `engines` are up or coming back;
        returns the requests moved by the removals."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        moved = 0
        with self._scale_lock:
            while self.engine_count() < engines:
                self.add_engine()
            while self.engine_count() > engines:
                moved += self.remove_engine(None, timeout_s)
        return moved

    def rollout(self: Any, config: EngineConfig, timeout_s: float = 60.0) -> int:
        """Replace the engines one at a time with engines of `config` (same
        model), each drained through migration first: no request is lost and
        every stream continues token-exact. With a single engine up, its
        successor starts first. Returns the requests moved."""
        if config.model != self.config.model or config.max_model_len != self.config.max_model_len:
            raise ValueError("a rollout keeps the model and max_model_len; start a new server for another")
        self._check_can_scale()
        moved = 0
        with self._scale_lock:
            for i in [i for i in range(len(self.clients)) if i not in self._removed]:
                if self.states[i] == UP and sum(s == UP for s in self.states) < 2:
                    self.add_engine(config)
                    moved += self.remove_engine(i, timeout_s)
                else:
                    moved += self.replace_engine(i, config, timeout_s)
            self.config = config
        return moved

    def reload(self: Any, config: EngineConfig | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Apply a changed config (default: read again from config_source):
        engine settings roll out engine by engine, autoscaling knobs apply at
        once. ValueError (nothing changed) for a changed model or a key the
        frontend was built with (conveyor/engine/dp/reload_plan.py)."""
        if config is None:
            if self.config_source is None:
                raise ValueError("this client has no config file to reload; pass the new config")
            config = self.config_source()
        plan = plan_reload(self.config, config)
        with self._scale_lock:
            moved = self.rollout(config, timeout_s) if plan.engine_keys else 0
            self.config = config
            if plan.scale_keys:
                self._set_autoscaling(config)
                s = ScaleSettings.from_config(config)  # a count now out of bounds moves to them at once
                if not s.min_engines <= self.engine_count() <= s.max_engines:
                    moved += self.scale_to(min(max(self.engine_count(), s.min_engines), s.max_engines), timeout_s)
        log.info("config reloaded: %s changed; %d requests moved", ", ".join(plan.keys) or "nothing", moved)
        return {"changed": list(plan.keys), "rolled_out": bool(plan.engine_keys), "moved_requests": moved}


class Autoscaler:
    """A thread that looks at the load every `interval_s` and adds or
    removes one engine when the policy says so."""

    def __init__(self, dp: Any, settings: ScaleSettings, interval_s: float,
                 clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        self.dp, self.policy, self.interval_s, self.clock = dp, ScalePolicy(settings), interval_s, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-autoscaler", daemon=True)
        if start:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> int:
        """One look: +1, -1 or 0 engines changed."""
        dp = self.dp
        if not dp._scale_lock.acquire(blocking=False):
            self.policy.decide(LoadSnapshot(dp.load_snapshot().engines, busy=True), self.clock())
            return 0
        try:
            snap = dp.load_snapshot()
            change = self.policy.decide(snap, self.clock()) - len(snap.engines)
            if change > 0:
                log.info("autoscaling up: %s", snap.engines)
                dp.add_engine()
            elif change < 0:
                log.info("autoscaling down: %s", snap.engines)
                dp.remove_engine()
            return change
        except Exception:  # noqa: BLE001 - a failed start or drain is retried on a later look
            log.exception("autoscaling step failed")
            return 0
        finally:
            dp._scale_lock.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
