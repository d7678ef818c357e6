"""The engines of a data-parallel client: one slot per engine, each with its
client, its state and what it last reported.

Slots are never renumbered: an engine's index names it in metrics, admin
routes and logs for its whole life; a scale-down leaves the slot empty (OFF)
until an add reuses it. The owner (DataParallelClient) changes a state only
under its lock, and grows the lists under it in the order unlocked readers
index them (states before clients).
"""
from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from conveyor.engine.config import EngineConfig
from conveyor.engine.contracts import EngineCoreRequest, KVCacheInfo, SchedulerStats
from conveyor.engine.core_client import CoreClient, FleetAdmin, OutputHandler
from conveyor.engine.errors import DeadFlag, EngineDeadError


class EngineState(enum.StrEnum):
    """UP takes requests; DRAINED takes none until undrain; LOST takes none
    while its client rebuilds it (then UP); DEAD is gone for good (its slot
    can be refilled by replace); OFF is an empty slot (scaled down)."""

    UP = "up"
    DRAINED = "drained"
    LOST = "lost"
    DEAD = "dead"
    OFF = "off"

    @property
    def gone(self) -> bool:
        """Out of service for good (dead, or an empty slot): its late outputs
        are dropped and it holds no request."""
        return self in (EngineState.DEAD, EngineState.OFF)


def engine_config(config: EngineConfig) -> EngineConfig:
    """The config each in-process engine runs: uniproc workers go to a process
    of their own (one process holds one torch.distributed world); on CPU every
    engine's workers share this machine's cores (unless
    parallel.cpu_threads_per_worker says otherwise)."""
    p = config.parallel
    if p.executor not in ("uniproc", "mp") or config.core_in_actor():
        return config
    threads = p.cpu_threads_per_worker or max(1, (os.cpu_count() or 1) // (
        config.world_size * p.data_parallel_size))
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(
        p, executor="mp", cpu_threads_per_worker=threads))


class Vacant:
    """The client of an empty slot: holds nothing, does nothing."""

    started_ray = False

    def __init__(self, kv_info: KVCacheInfo) -> None:
        self.kv_info = kv_info
        self.dead = DeadFlag()

    @property
    def admin(self) -> FleetAdmin | None:
        return None

    def start(self, on_outputs: OutputHandler) -> None:
        pass

    def add_request(self, request: EngineCoreRequest) -> None:
        raise EngineDeadError("engine slot is empty")

    def abort_requests(self, request_ids: list[str]) -> None:
        pass

    def resume(self, tag: int, requests: list[EngineCoreRequest]) -> None:
        pass

    def request_kv_snapshot(self) -> None:
        pass

    def hand_over_losses(self, on_lost: Callable[[str], None], on_back: Callable[[], None]) -> None:
        pass

    def check_health(self) -> str:
        raise EngineDeadError("engine slot is empty")

    def worker_pids(self) -> list[int]:
        return []

    def engine_pid(self) -> int | None:
        return None

    def shutdown(self) -> None:
        pass


@dataclass
class Slot:
    client: CoreClient
    state: EngineState = EngineState.UP
    stats: SchedulerStats | None = None  # its last report
    prefix_queries: int = 0  # prefix-cache lookups, in tokens, since it started
    prefix_hits: int = 0
    # An engine is (slot, incarnation): a client put in the slot again is a new engine.
    incarnation: int = 0


@dataclass
class Fleet:
    slots: list[Slot] = field(default_factory=list)

    @classmethod
    def start(cls, config: EngineConfig, spawn: Callable[[EngineConfig], CoreClient]) -> Fleet:
        """data_parallel_size engines from `spawn`; on a failure the started ones shut down."""
        clients: list[CoreClient] = []
        try:
            for _ in range(config.parallel.data_parallel_size):
                clients.append(spawn(config))
        except BaseException:
            for c in clients:
                c.shutdown()
            raise
        return cls([Slot(c) for c in clients])

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def clients(self) -> list[CoreClient]:
        return [s.client for s in self.slots]

    @property
    def states(self) -> list[EngineState]:
        return [s.state for s in self.slots]

    def client(self, i: int) -> CoreClient:
        return self.slots[i].client

    def state(self, i: int) -> EngineState:
        return self.slots[i].state

    def set_state(self, i: int, state: EngineState) -> None:
        self.slots[i].state = state

    def up(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state is EngineState.UP]

    def any_up(self, besides: int | None = None) -> bool:
        return any(s.state is EngineState.UP for i, s in enumerate(self.slots) if i != besides)

    def in_service(self) -> int:
        """Engines up or coming back (lost)."""
        return sum(s.state in (EngineState.UP, EngineState.LOST) for s in self.slots)

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.state is EngineState.OFF]

    def check_index(self, i: int) -> None:
        if not 0 <= i < len(self.slots):
            raise ValueError(f"engine must be in [0, {len(self.slots)}), got {i}")

    def put(self, i: int, client: CoreClient) -> None:
        """A started client in slot i (appended when i == len), its counters reset, not yet up."""
        slot = Slot(client, EngineState.DEAD)
        if i == len(self.slots):
            self.slots.append(slot)
        else:
            slot.incarnation = self.slots[i].incarnation + 1
            self.slots[i] = slot

    def ray_owner(self) -> int | None:
        """The slot whose client started the Ray instance (it shuts down last)."""
        return next((i for i, s in enumerate(self.slots) if s.client.started_ray), None)
