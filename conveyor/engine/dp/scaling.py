"""Engines added and removed while serving: autoscaling between
serve.min_engines and serve.max_engines, and a rollout of a changed config,
all without losing a request. FleetScaler is the DataParallelClient's part
for it (conveyor/engine/dp/client.py), over the client's slot mechanism
(new_slot, install, retire, let_go, drain, replace_engine).

- `add_engine` starts one more engine (from the client's spawn function) into
  a free slot, or a new one (the router gets one more engine), and routes to
  it once it runs.
- `remove_engine` drains an engine through migration (its requests continue
  on the others, token-exact) and then shuts it down; its slot stays empty
  (OFF) until an add reuses it.
- `rollout` replaces the engines one at a time with the new config; the last
  engine up is never drained onto nothing: a new engine starts first.
- `reload` checks a changed config (conveyor/engine/dp/reload_plan.py) and does the above.
- `Autoscaler` samples the engines' load every serve.autoscale_interval_s
  and applies `ScalePolicy` (conveyor/engine/dp/scale_policy.py).

Invariants: one fleet change at a time (`lock`, re-entrant: a rollout adds
and removes, replace_engine takes it too); the autoscaler never waits for it
(it skips a look). Slots are never renumbered.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from conveyor.engine.config import EngineConfig
from conveyor.engine.core_client import CoreClient
from conveyor.engine.dp.fleet import EngineState, Fleet
from conveyor.engine.dp.reload_plan import plan_reload
from conveyor.engine.dp.scale_policy import EngineLoad, LoadSnapshot, ScalePolicy, ScaleSettings

log = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 120.0  # the longest shutdown waits for an engine being started or drained


class ScaledClient(Protocol):
    """What FleetScaler needs of its client (DataParallelClient)."""

    config: EngineConfig
    fleet: Fleet

    def spawn(self, config: EngineConfig) -> CoreClient: ...
    def drain(self, engine: int, timeout_s: float = 60.0) -> int: ...
    def replace_engine(self, engine: int, config: EngineConfig | None = None, timeout_s: float = 60.0) -> int: ...
    def new_slot(self) -> int: ...
    def install(self, slot: int, new: CoreClient) -> None: ...
    def retire(self, slot: int, state: EngineState) -> CoreClient: ...
    def let_go(self, old: CoreClient) -> None: ...
    def held_per_engine(self) -> dict[int, int]: ...


class FleetScaler:
    # False where the engines are not this client's to start or stop (the
    # engine pool of several ingress replicas, conveyor/cluster/engine_pool.py).
    can_scale = True

    def __init__(self, client: ScaledClient) -> None:
        self.client = client
        self.lock = threading.RLock()
        # Where reload() reads the config again (set by whoever loaded it: the Serve replica).
        self.config_source: Callable[[], EngineConfig] | None = None
        self.autoscaler: Autoscaler | None = None
        self._set_autoscaling(client.config)

    def _check_can_scale(self) -> None:
        if not self.can_scale:
            raise ValueError("these engines belong to the app's engine pool (serve.replicas > 1): they are "
                             "not added, removed or rolled out from one replica")

    def _set_autoscaling(self, config: EngineConfig) -> None:
        settings = ScaleSettings.from_config(config)
        if self.autoscaler is not None:
            self.autoscaler.stop()
            self.autoscaler = None
        if settings.enabled:
            self.autoscaler = Autoscaler(self, settings, config.serve.autoscale_interval_s)

    def stop(self) -> None:
        """Before shutdown: no more looks, and a fleet change under way
        finishes first (an engine it starts must not outlive the client)."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if self.lock.acquire(timeout=SHUTDOWN_WAIT_S):
            self.lock.release()

    def load_snapshot(self) -> LoadSnapshot:
        """The up engines' last reported load; busy while one is being rebuilt."""
        cap = self.client.config.scheduler.max_num_seqs
        slots = list(self.client.fleet.slots)
        loads = tuple(EngineLoad(s.stats.num_waiting_reqs, s.stats.num_running_reqs, s.stats.kv_cache_usage, cap)
                      if s.stats is not None else EngineLoad(0, 0, 0.0, cap)
                      for s in slots if s.state is EngineState.UP)
        return LoadSnapshot(loads, busy=any(s.state is EngineState.LOST for s in slots))

    def add_engine(self, config: EngineConfig | None = None) -> int:
        """Start one more engine (of `config`, default the client's) and
        route to it once it runs; returns its slot."""
        self._check_can_scale()
        c = self.client
        with self.lock:
            new = c.spawn(config if config is not None else c.config)
            slot = c.new_slot()
            c.install(slot, new)
        log.info("engine %d added (%d engines up)", slot, c.fleet.in_service())
        return slot

    def remove_engine(self, engine: int | None = None, timeout_s: float = 60.0) -> int:
        """Drain `engine` (default: the up engine holding the fewest
        requests) through migration, then shut it down; returns how many
        requests moved. ValueError when it is the only engine up."""
        self._check_can_scale()
        c = self.client
        with self.lock:
            if engine is None:
                engine = self._victim()
            elif not 0 <= engine < len(c.fleet) or c.fleet.state(engine) is EngineState.OFF:
                raise ValueError(f"engine {engine} is not an engine in service")
            # A dead engine (restart budget spent) holds nothing: only its slot is emptied.
            moved = 0 if c.fleet.state(engine) is EngineState.DEAD else c.drain(engine, timeout_s)
            c.let_go(c.retire(engine, EngineState.OFF))
        log.info("engine %d removed (%d requests moved off it; %d engines up)", engine, moved,
                 c.fleet.in_service())
        return moved

    def _victim(self) -> int:
        held = self.client.held_per_engine()
        if len(held) < 2:
            raise ValueError("one engine is up: no engine to take its requests")
        owner = self.client.fleet.ray_owner()
        # Fewest requests to move; the Ray owner last (it must outlive the others); then the newest.
        return min(held, key=lambda i: (i == owner, held[i], -i))

    def scale_to(self, engines: int, timeout_s: float = 60.0) -> int:
        """Add or remove engines until `engines` are up or coming back;
        returns the requests moved by the removals."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        moved = 0
        with self.lock:
            while self.client.fleet.in_service() < engines:
                self.add_engine()
            while self.client.fleet.in_service() > engines:
                moved += self.remove_engine(None, timeout_s)
        return moved

    def rollout(self, config: EngineConfig, timeout_s: float = 60.0) -> int:
        """Replace the engines one at a time with engines of `config` (same
        model), each drained through migration first: no request is lost and
        every stream continues token-exact. With a single engine up, its
        successor starts first. Returns the requests moved."""
        c = self.client
        if config.model != c.config.model or config.max_model_len != c.config.max_model_len:
            raise ValueError("a rollout keeps the model and max_model_len; start a new server for another")
        self._check_can_scale()
        moved = 0
        with self.lock:
            for i in [i for i in range(len(c.fleet)) if c.fleet.state(i) is not EngineState.OFF]:
                if c.fleet.state(i) is EngineState.UP and not c.fleet.any_up(besides=i):
                    self.add_engine(config)
                    moved += self.remove_engine(i, timeout_s)
                else:
                    moved += c.replace_engine(i, config, timeout_s)
            c.config = config
        return moved

    def reload(self, config: EngineConfig | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """Apply a changed config (default: read again from config_source):
        engine settings roll out engine by engine, autoscaling knobs apply at
        once. ValueError (nothing changed) for a changed model or a key the
        frontend was built with (conveyor/engine/dp/reload_plan.py)."""
        if config is None:
            if self.config_source is None:
                raise ValueError("this client has no config file to reload; pass the new config")
            config = self.config_source()
        c = self.client
        plan = plan_reload(c.config, config)
        with self.lock:
            moved = self.rollout(config, timeout_s) if plan.engine_keys else 0
            c.config = config
            if plan.scale_keys:
                self._set_autoscaling(config)
                s = ScaleSettings.from_config(config)  # a count now out of bounds moves to them at once
                n = c.fleet.in_service()
                if not s.min_engines <= n <= s.max_engines:
                    moved += self.scale_to(min(max(n, s.min_engines), s.max_engines), timeout_s)
        log.info("config reloaded: %s changed; %d requests moved", ", ".join(plan.keys) or "nothing", moved)
        return {"changed": list(plan.keys), "rolled_out": bool(plan.engine_keys), "moved_requests": moved}


class Autoscaler:
    """A thread that looks at the load every `interval_s` and adds or
    removes one engine when the policy says so."""

    def __init__(self, scaler: FleetScaler, settings: ScaleSettings, interval_s: float,
                 clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        self.scaler, self.policy, self.interval_s, self.clock = scaler, ScalePolicy(settings), interval_s, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-autoscaler", daemon=True)
        if start:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> int:
        """One look: +1, -1 or 0 engines changed."""
        sc = self.scaler
        if not sc.lock.acquire(blocking=False):
            self.policy.decide(LoadSnapshot(sc.load_snapshot().engines, busy=True), self.clock())
            return 0
        try:
            snap = sc.load_snapshot()
            change = self.policy.decide(snap, self.clock()) - len(snap.engines)
            if change > 0:
                log.info("autoscaling up: %s", snap.engines)
                sc.add_engine()
            elif change < 0:
                log.info("autoscaling down: %s", snap.engines)
                sc.remove_engine()
            return change
        except Exception:  # noqa: BLE001 - a failed start or drain is retried on a later look
            log.exception("autoscaling step failed")
            return 0
        finally:
            sc.lock.release()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
