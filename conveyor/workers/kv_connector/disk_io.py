"""The disk tier's file work, off the step's path: one writer thread (writes
and deletes, in order) and a few reader threads. Files are those of
conveyor/engine/kv_connector/disk_format.py."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from conveyor.engine.kv_connector import disk_format

log = logging.getLogger(__name__)


class DiskIO:
    def __init__(self, folder: Path, model_id: str, nbytes: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.model_id = model_id
        self.nbytes = nbytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="conveyor-kv-disk-w")
        self._reader = ThreadPoolExecutor(4, thread_name_prefix="conveyor-kv-disk-r")
        self._writes: list[tuple[bytes, Future[None]]] = []

    def write(self, key: bytes, payload: bytes) -> None:
        self._writes.append((key, self._writer.submit(self._write, key, payload)))

    def _write(self, key: bytes, payload: bytes) -> None:
        disk_format.write_atomic(self.folder, key, disk_format.encode(key, self.model_id, payload))

    def delete(self, key: bytes) -> None:
        self._writer.submit(disk_format.block_path(self.folder, key).unlink, missing_ok=True)

    def read(self, key: bytes, wait_s: float = 0.0) -> Future[bytes | None]:
        """The verified payload, or None (missing, torn, corrupted, foreign).
        wait_s: another engine may still be writing it; a missing file is
        looked for again until then (a file appears whole: written, then renamed)."""
        # One deadline from now: a load's reads queued behind each other share it.
        return self._reader.submit(self._read, key, time.monotonic() + wait_s)

    def _read(self, key: bytes, until: float) -> bytes | None:
        data = disk_format.read(self.folder, key)
        if data is None and time.monotonic() < until:
            pause = 0.0005
            while data is None and time.monotonic() < until:
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                data = disk_format.read(self.folder, key)
        return None if data is None else disk_format.decode(data, key, self.model_id, self.nbytes)

    def finished_writes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys now durable, keys whose write failed) since the last call."""
        saved: list[bytes] = []
        failed: list[bytes] = []
        still = []
        for key, fut in self._writes:
            if not fut.done():
                still.append((key, fut))
            elif fut.exception() is not None:
                log.warning("KV disk tier: writing block %s failed: %s", key.hex()[:16], fut.exception())
                failed.append(key)
            else:
                saved.append(key)
        self._writes = still
        return saved, failed

    def close(self) -> None:
        """Writes finish (a restarted engine finds them); pending reads are dropped."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
