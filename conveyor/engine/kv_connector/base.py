"""The scheduler side of a KV connector (the seed's contract).

The scheduler asks, for a waiting request whose local prefix hit ends at
num_local tokens, how many more tokens the connector can supply; it then
allocates pool blocks for them and parks the request in
WAITING_FOR_REMOTE_KVS until the worker side reports the load finished.
Conveyor parks every external load, so a block is used only after the worker
checked it (is_async is part of the seed's signature; False is treated as True).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.core.request import Request
from conveyor.engine.kv_connector.metadata import KVConnectorMetadata, KVConnectorOutput


@dataclass
class LoadResult:
    """A finished load: the request got num_valid_tokens (from where: tokens
    per tier name) after its local hit; the rest of its blocks are recomputed."""
    load_id: int
    req_id: str
    num_valid_tokens: int
    by_source: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0  # the valid blocks' bytes (all ranks)


@dataclass
class TierStats:
    """Since the last take: tokens reused per source, bytes moved, failures;
    occupancy (blocks held per tier) is a gauge."""
    reused_tokens: dict[str, int] = field(default_factory=dict)
    transfer_bytes: int = 0
    transfer_failures: int = 0
    tier_blocks: dict[str, int] = field(default_factory=dict)


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> tuple[int, bool]:
        """(tokens beyond num_local_computed the connector can load, load is async)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> int:
        """The request holds block_ids (its whole table); load the external
        tokens into them. Returns the load's id."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """Everything decided since the last call, for this step's SchedulerOutput."""

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> list[LoadResult]:
        """Apply one step's worker report; the loads it finished."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until the worker reports them saved, kv_transfer_params)."""

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """A computed block is about to be reused by the pool (BlockPool hook)."""
        return None  # optional hook: nothing to do by default

    def request_reset(self, request_id: str) -> None:
        """Forget the request's per-request state (preemption, a load given up)."""
        return None  # optional hook: nothing to do by default

    def give_up_load(self, load_id: int, request_id: str) -> None:
        """The scheduler stopped waiting for this load (deadline, abort): its
        result, when it comes, is only for releasing the blocks."""
        return None  # optional hook: nothing to do by default

    def has_pending(self) -> bool:
        """Work to send the workers even if no request runs."""
        return False

    def reset(self, lost_workers: bool) -> None:
        """The prefix cache was reset (or the worker group, and with it the host tier, lost)."""
        return None  # optional hook: nothing to do by default

    def release_lease(self, request_id: str) -> None:
        """The blocks a finished request leased for another engine were taken
        (P/D: the decode engine has them); they may go before the deadline."""
        return None  # optional hook: a connector without leases has nothing to release

    def attach_events(self, events: Any) -> None:
        """The data-parallel router's event publisher: report what the connector holds."""
        return None  # optional hook: a connector that holds nothing reports nothing

    def take_stats(self) -> TierStats | None:
        return None

    def close(self) -> None:
        """Engine shutdown."""
        return None  # optional hook: nothing to do by default
