"""A durable record of the tokens each request generated, so a job run again
after its whole cluster was lost does not generate them again (issue 26).

`TokenJournal` is an append-only file of msgspec-JSON lines, one per request
and flush: the tokens (and their logprobs, when asked for) delivered since the
last flush, the first prefix-cache hit the frontend saw, and the finish when
the engine reported one. `JournalClient` wraps a CoreClient (one engine, or
the data-parallel client): it journals every output before the frontend sees
it, and a request added under a key the journal knows is answered from the
journal first (one output carrying all recorded tokens) and then sent to the
engine with those tokens as `output_token_ids` (the resume path: the engine
goes on at the next output position, seeded draws, penalties and grammar as if
nothing happened). A request the journal saw finish is answered entirely from
it and never reaches the engine.

Invariants:
- Recompute is bounded: the journal flushes (one write + fdatasync) whenever
  the tokens not yet on disk reach max(min_flush_tokens, recompute_fraction x
  all tokens journaled so far), so a crash loses at most that many (1% by
  default, after the first few hundred tokens).
- The file is bounded: keys are forgotten once their result is written
  elsewhere (forget_prefix), and the file is rewritten with only the live
  entries when it grows past twice their size.
- A record's tokens and its finish are one line, written whole or not at all
  (a torn last line is dropped on open): a journaled final token always comes
  with its finish.
- Keys are request ids without their last "-suffix" (AsyncLLM appends a random
  one per call): the caller keeps the rest stable across runs.
- Requests asking for prompt logprobs are not journaled (recomputed whole).
- Data parallel batch jobs (`--data-parallel N`, one engine per actor): engine
  i writes its own file (`<journal>.i`) and restores from the job's merged
  one (`restore_from`), which the driver folds every file into before a run
  (merge_journals: per key the entry with the most tokens, since each file's
  entry of a key is a prefix of the same continuation). An engine that
  resumes a key first writes its whole entry to its own file, so a later
  merge never loses a token an earlier run delivered.
"""
from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from conveyor.engine.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

log = logging.getLogger(__name__)


class _Rec(msgspec.Struct, omit_defaults=True):
    k: str
    t: list[int] = []
    lp: list[dict[int, float]] | None = None
    c: int | None = None  # the first num_cached_tokens the frontend saw
    f: int | None = None  # FinishReason value
    s: int | str | None = None  # stop reason
    g: bool = False  # stopped by grammar
    d: bool = False  # forgotten


@dataclass
class Entry:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cached: int | None = None
    finish: int | None = None
    stop: int | str | None = None
    grammar: bool = False

    def apply(self, r: _Rec) -> None:
        self.tokens += r.t
        if r.lp is not None:
            self.logprobs = (self.logprobs or []) + r.lp
        if r.c is not None and self.cached is None:
            self.cached = r.c
        if r.f is not None:
            self.finish, self.stop, self.grammar = r.f, r.s, r.g

    def record(self, key: str) -> _Rec:
        return _Rec(key, list(self.tokens), self.logprobs, self.cached, self.finish, self.stop, self.grammar)


def journal_key(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


def load_entries(path: str) -> dict[str, Entry]:
    """The entries a journal file holds (none if it does not exist)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    entries: dict[str, Entry] = {}
    dec = msgspec.json.Decoder(_Rec)
    for raw in data[:data.rfind(b"\n") + 1].split(b"\n"):  # a torn last line is dropped
        if not raw.strip():
            continue
        try:
            r = dec.decode(raw)
        except msgspec.DecodeError:
            log.warning("%s: skipping an unreadable journal line", path)
            continue
        if r.d:
            entries.pop(r.k, None)
        else:
            entries.setdefault(r.k, Entry()).apply(r)
    return entries


def write_entries(path: str, entries: dict[str, Entry]) -> None:
    """Replace the file with one line per entry (atomically, synced)."""
    enc, tmp = msgspec.json.Encoder(), path + ".tmp"
    with open(tmp, "wb") as f:
        for k, e in entries.items():
            f.write(enc.encode(e.record(k)) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def engine_journals(path: str) -> list[str]:
    """The per-engine files (`path.0`, `path.1`, ...) of a data-parallel job's journal."""
    return sorted(p for p in glob.glob(glob.escape(path) + ".*") if p.rsplit(".", 1)[1].isdigit())


def merge_journals(path: str, keep: Callable[[str], bool]) -> int:
    """Fold a data-parallel run's per-engine journals into `path`: per key the
    entry with the most tokens (a finished one over an unfinished one of the
    same length); keys `keep` rejects are dropped (lines already written).
    The per-engine files are removed; an empty result removes `path` too.
    Returns the tokens kept."""
    parts = [path] + engine_journals(path)
    merged: dict[str, Entry] = {}
    for p in parts:
        for k, e in load_entries(p).items():
            m = merged.get(k)
            if m is None or (len(e.tokens), e.finish is not None) > (len(m.tokens), m.finish is not None):
                merged[k] = e
    merged = {k: e for k, e in merged.items() if keep(k)}
    if merged:
        write_entries(path, merged)
    elif os.path.exists(path):
        os.remove(path)
    for p in parts[1:]:
        os.remove(p)
    return sum(len(e.tokens) for e in merged.values())


class TokenJournal:
    def __init__(self, path: str, recompute_fraction: float = 0.01, min_flush_tokens: int = 256,
                 restore_from: str | None = None) -> None:
        """restore_from: another journal whose entries this one may resume
        (read only; a data-parallel engine's view of the job's merged file)."""
        self.path, self.fraction, self.min_flush = path, recompute_fraction, min_flush_tokens
        self.entries: dict[str, Entry] = load_entries(path)
        self.restored = {k: e for k, e in self.entries.items() if e.tokens}  # resumable, not yet resumed
        for k, e in (load_entries(restore_from) if restore_from else {}).items():
            if len(e.tokens) > len(self.entries[k].tokens if k in self.entries else ()):
                self.restored[k] = e  # adopted into this file when resumed (adopt)
        self.restored_tokens = sum(len(e.tokens) for e in self.restored.values())
        self.total = self.restored_tokens  # every token journaled, restored ones included
        self._pending: list[_Rec] = []
        self._pending_tokens = 0
        self._enc = msgspec.json.Encoder()
        self._compact()

    def _compact(self) -> None:
        """Rewrite the file with one line per live entry (atomically)."""
        write_entries(self.path, self.entries)
        self._live_bytes = os.path.getsize(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def absorb(self, key: str, o: EngineCoreOutput) -> None:
        e = self.entries.setdefault(key, Entry())
        r = _Rec(key, list(o.new_token_ids), list(o.new_logprobs) if o.new_logprobs else None,
                 o.num_cached_tokens if e.cached is None else None)
        if o.finished and o.finish_reason is not None:  # a finished output names its reason
            r.f, r.s, r.g = int(o.finish_reason), o.stop_reason, o.stopped_by_grammar
        e.apply(r)
        self._pending.append(r)
        self._pending_tokens += len(r.t)
        self.total += len(r.t)

    def adopt(self, key: str, prior: Entry) -> None:
        """A restored entry is being resumed: it becomes this file's entry of
        the key, whole (the key's next tokens are appended to it), unless it
        is this file's own already."""
        if self.entries.get(key) is prior:
            return
        if key in self.entries:
            self._pending.append(_Rec(key, d=True))
        self.entries[key] = prior
        self._pending.append(prior.record(key))

    def forget(self, keys: list[str]) -> None:
        for k in keys:
            if self.entries.pop(k, None) is not None:
                self._pending.append(_Rec(k, d=True))

    def maybe_flush(self) -> None:
        if self._pending_tokens >= max(self.min_flush, self.fraction * self.total):
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._enc.encode(r) + b"\n" for r in self._pending)
        self._pending, self._pending_tokens = [], 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fdatasync(self._fd)
        self._live_bytes += len(data)
        if os.path.getsize(self.path) > 2 * (1 << 20) + 2 * sum(8 * len(e.tokens) for e in self.entries.values()):
            os.close(self._fd)
            self._compact()

    def close(self) -> None:
        """Flush; a journal with nothing left in it (every result stored) is removed."""
        self.flush()
        os.close(self._fd)
        if not self.entries:
            os.remove(self.path)


class JournalClient:
    """A CoreClient that journals outputs and resumes journaled requests (module doc)."""

    def __init__(self, inner: Any, journal: TokenJournal) -> None:
        self.inner, self.journal = inner, journal
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}  # engine request id -> journal key
        self._emit: Callable[[EngineCoreOutputs], None] | None = None
        self.resumed_tokens = 0  # tokens answered from the journal (not generated again)

    def __getattr__(self, name: str) -> Any:  # everything else: the wrapped client's
        return getattr(self.inner, name)

    def start(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        self._emit = on_outputs
        self.inner.start(self._handle)

    def _handle(self, outs: EngineCoreOutputs) -> None:
        with self._lock:
            for o in outs.outputs:
                key = self._keys.get(o.request_id)
                if key is None:
                    continue
                self.journal.absorb(key, o)
                cached = self.journal.entries[key].cached
                if cached is not None:
                    o.num_cached_tokens = cached  # usage stays what the first run reported
                if o.finished:
                    del self._keys[o.request_id]
            self.journal.maybe_flush()
        assert self._emit is not None
        self._emit(outs)

    def add_request(self, request: EngineCoreRequest) -> None:
        key = journal_key(request.request_id)
        with self._lock:
            prior = self.journal.restored.pop(key, None)
            if request.sampling_params.prompt_logprobs is None:
                self._keys[request.request_id] = key
            if prior is not None:
                self.journal.adopt(key, prior)
        if prior is None:
            self.inner.add_request(request)
            return
        self.resumed_tokens += len(prior.tokens)
        assert self._emit is not None
        # The frontend sees the journaled tokens first, as one output (its
        # stop strings, detokenizer, logprobs and usage go over them once).
        finish = FinishReason(prior.finish) if prior.finish is not None else None
        self._emit(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request.request_id, list(prior.tokens), finish, prior.stop, prior.logprobs,
            num_cached_tokens=prior.cached or 0, stopped_by_grammar=prior.grammar)]))
        if finish is not None:
            with self._lock:
                self._keys.pop(request.request_id, None)
            return  # finished in the earlier run: nothing left to generate
        self.inner.add_request(msgspec.structs.replace(request, output_token_ids=list(prior.tokens)))

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._keys.pop(rid, None)
        self.inner.abort_requests(request_ids)

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            with self._lock:
                self.journal.close()


def journal_path(output_path: str) -> str:
    """A batch job's journal: beside its output file (same rerun, same journal)."""
    return output_path + ".tokens"


class LineJournal(JournalClient):
    """The batch job's view: one id per input line, stable across runs."""

    @staticmethod
    def line_of(key: str) -> str | None:
        """The line id a journal key belongs to (keys hold it between dashes)."""
        i = key.find("-batch-")
        return key[i + 1:i + 39] if i >= 0 else None

    @staticmethod
    def line_id(obj: dict[str, Any]) -> str:
        """The same line (custom_id and body) gets the same id in every run."""
        import hashlib
        import json

        blob = json.dumps([obj.get("custom_id"), obj.get("url"), obj.get("body")], sort_keys=True,
                          ensure_ascii=True, default=str)
        return "batch-" + hashlib.sha256(blob.encode()).hexdigest()[:32]

    def forget_line(self, line_id: str) -> None:
        """The line's record is being written: its requests' tokens are done with."""
        mark = f"-{line_id}-"
        with self._lock:
            self.journal.forget([k for k in self.journal.entries if mark in k])
            for k in [k for k in self.journal.restored if mark in k]:
                del self.journal.restored[k]
            self.journal.maybe_flush()


    def forget_lines(self, objs: list[dict[str, Any]]) -> None:
        """Lines an earlier run already wrote (their forget may not have reached the disk)."""
        for obj in objs:
            self.forget_line(self.line_id(obj))


def journaled_client(config: Any, path: str, restore_from: str | None = None) -> LineJournal:
    from conveyor.engine.config import check_model_dir
    from conveyor.engine.frontend.clients import make_core_client

    check_model_dir(config)
    return LineJournal(make_core_client(config), TokenJournal(path, restore_from=restore_from))
