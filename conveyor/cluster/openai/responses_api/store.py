"""Stored `/v1/responses` (store: true), for retrieve, delete and
`previous_response_id`.

One small async protocol, two implementations:
- `RayResponseStore`: a named Ray actor (`ResponseStoreActor`, found or
  created with get_if_exists, not detached) in front of a sqlite file in
  `serve.responses_store_dir`. Every ingress replica reaches the same actor,
  so a follow-up may land on any replica; the actor fate-shares with the
  replica that created it, and a replica that finds it gone creates it again
  over the same file, so stored responses outlive replica restarts (the file
  is on the actor's node: a store recreated on another node starts empty).
- `LocalResponseStore`: the same sqlite logic in memory, in this process (the
  FastAPI app outside Ray Serve: tests, `AsyncLLM` embedders).

Invariants:
- Bounded: at most `max_entries` records (the oldest go first) and none older
  than `ttl_s` is ever returned (expired rows are purged on each put).
- A record is JSON text (never pickle); what it holds is the caller's business.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from typing import Any, Protocol

log = logging.getLogger("conveyor.serve")

ACTOR_NAME = "conveyor-response-store"
ACTOR_NAMESPACE = "conveyor"
_ATTEMPTS = 4


class ResponseStore(Protocol):
    async def put(self, rid: str, record: dict[str, Any]) -> None: ...

    async def get(self, rid: str) -> dict[str, Any] | None: ...

    async def delete(self, rid: str) -> bool: ...


class SqliteResponses:
    """The bounded, expiring table behind both stores (synchronous)."""

    def __init__(self, path: str, max_entries: int, ttl_s: float) -> None:
        """path: a sqlite file, or ":memory:"."""
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._lock = threading.Lock()  # one connection, used from any thread
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses "
                         "(id TEXT PRIMARY KEY, created REAL NOT NULL, body TEXT NOT NULL)")
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")

    def put(self, rid: str, body: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?)", (rid, now, body))
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY "
                             "created DESC, rowid DESC LIMIT -1 OFFSET ?)", (self.max_entries,))

    def get(self, rid: str, now: float | None = None) -> str | None:
        now = time.time() if now is None else now
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ? AND created >= ?",
                                   (rid, now - self.ttl_s)).fetchone()
        return None if row is None else row[0]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (rid,)).rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]


class LocalResponseStore:
    """In this process only (no Ray)."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.table = SqliteResponses(":memory:", max_entries, ttl_s)

    async def put(self, rid: str, record: dict[str, Any]) -> None:
        self.table.put(rid, json.dumps(record))

    async def get(self, rid: str) -> dict[str, Any] | None:
        body = self.table.get(rid)
        return None if body is None else json.loads(body)

    async def delete(self, rid: str) -> bool:
        return self.table.delete(rid)


class ResponseStoreActor:
    """The cluster's store: one per Ray namespace `conveyor` (see module doc)."""

    def __init__(self, directory: str, max_entries: int, ttl_s: float) -> None:
        os.makedirs(directory, exist_ok=True)
        self.table = SqliteResponses(os.path.join(directory, "responses.sqlite3"), max_entries, ttl_s)

    def put(self, rid: str, body: str) -> None:
        self.table.put(rid, body)

    def get(self, rid: str) -> str | None:
        return self.table.get(rid)

    def delete(self, rid: str) -> bool:
        return self.table.delete(rid)


def default_store_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "conveyor-responses")


class RayResponseStore:
    """The client side of ResponseStoreActor, for one replica."""

    def __init__(self, directory: str | None, max_entries: int, ttl_s: float) -> None:
        self._args = (directory or default_store_dir(), max_entries, ttl_s)
        self._actor: Any = None

    def _connect(self) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._actor is None:
            cls = ray.remote(num_cpus=0, max_restarts=0)(ResponseStoreActor)
            # Outside the replica's placement group (Serve captures child actors).
            outside = PlacementGroupSchedulingStrategy(placement_group=None)
            self._actor = cls.options(name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, get_if_exists=True,
                                      scheduling_strategy=outside).remote(*self._args)
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        """One call; if the actor died (its owner replica went away), find or
        create it again (the sqlite file keeps the records) and retry once."""
        from ray.exceptions import RayActorError

        for attempt in range(_ATTEMPTS):
            actor = await asyncio.to_thread(self._connect)
            try:
                return await getattr(actor, method).remote(*args)
            except RayActorError:
                if attempt == _ATTEMPTS - 1:
                    raise
                log.warning("response store actor is gone; reconnecting")
                self._actor = None
                await asyncio.sleep(0.2 * (attempt + 1))  # the GCS frees a dead actor's name
        return None

    async def put(self, rid: str, record: dict[str, Any]) -> None:
        await self._call("put", rid, json.dumps(record))

    async def get(self, rid: str) -> dict[str, Any] | None:
        body = await self._call("get", rid)
        return None if body is None else json.loads(body)

    async def delete(self, rid: str) -> bool:
        return bool(await self._call("delete", rid))
