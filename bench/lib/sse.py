"""The one streaming client of the OpenAI endpoints (server-sent events), for
every benchmark that loads a server: load curves, resilience scenarios and
the routing workloads.

``stream`` posts one request and reads its events into a ``Reply``. By
default only the events that matter are parsed as JSON (errors, the usage
chunk, events that finish a choice) and every other content event is only
timestamped: the client shares the machine's cores with the server, so its
CPU per event counts. ``full=True`` parses every event (the text, token
counts from logprobs, chat deltas). ``leave_after`` drops the connection
after that many events, as a client that walks away mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

_USAGE = re.compile(rb'"usage":\s*\{')  # the usage chunk (null usage elsewhere is not it)
_FINISH = b'"finish_reason":"'


@dataclass
class Reply:
    """What one streamed request saw; times are time.perf_counter()."""
    start: float = 0.0
    end: float = 0.0
    status: int = 0
    error: str = ""  # HTTP status, an error event's message, or the exception
    error_code: str = ""  # an error event's code
    body: bytes = b""  # a non-200 answer's body
    done: bool = False  # [DONE] arrived
    left: bool = False  # the client left after `leave_after` events
    events: int = 0  # data events, [DONE] not counted
    first: float = 0.0  # the first content event
    times: list[float] = field(default_factory=list)  # each event with choices
    counts: list[int] = field(default_factory=list)  # its tokens (full: logprobs, else 1 a text)
    text: str = ""  # full: completion text or chat content, choices concatenated
    finish: dict[int, str] = field(default_factory=dict)  # choice index -> finish_reason
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Answered 200 and streamed to its end without an error."""
        return self.status == 200 and not self.error and not self.left

    @property
    def ttft(self) -> float:
        return self.first - self.start if self.first else 0.0

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def output_tokens(self) -> int:
        """From the usage chunk when the server sent one, else counted."""
        return int(self.usage.get("completion_tokens", sum(self.counts)))

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive events from the first content event on."""
        ts = [t for t in self.times if t >= self.first] if self.first else []
        return [b - a for a, b in zip(ts, ts[1:])]

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else 0.0


async def stream(client: Any, path: str, body: dict[str, Any], *, full: bool = False,
                 leave_after: int | None = None) -> Reply:
    """POST ``body`` to ``path`` on an httpx.AsyncClient and read the stream;
    a transport failure is an error in the Reply, never an exception."""
    rep = Reply(start=time.perf_counter())
    try:
        async with client.stream("POST", path, json=body) as r:
            rep.status = r.status_code
            if r.status_code != 200:
                rep.body = await r.aread()
                rep.error = f"HTTP {r.status_code}: {rep.body[:200]!r}"
            else:
                await _read(r, rep, full, leave_after)
    except Exception as e:  # noqa: BLE001 - a failed request, counted by the caller
        rep.error = f"{type(e).__name__}: {e}"
    rep.end = time.perf_counter()
    return rep


async def _read(r: Any, rep: Reply, full: bool, leave_after: int | None) -> None:
    buf = b""
    async for data in r.aiter_bytes():
        now = time.perf_counter()
        *events, buf = (buf + data).split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data: "):
                continue
            if ev == b"data: [DONE]":
                rep.done = True
                continue
            rep.events += 1
            _take(rep, ev, now, full)
        if leave_after is not None and rep.events >= leave_after and not rep.done:
            rep.left = True
            return  # leaving the stream's context drops the connection mid-stream


def _take(rep: Reply, ev: bytes, now: float, full: bool) -> None:
    """One data event: parsed when it matters (or always with full), timestamped."""
    if not (full or b'"error"' in ev or _FINISH in ev or _USAGE.search(ev)):
        rep.times.append(now)
        rep.counts.append(1)
        rep.first = rep.first or now
        return
    obj = json.loads(ev[6:])
    if "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        rep.error, rep.error_code = str(err.get("message")), str(err.get("code", "?"))
        return
    if obj.get("usage"):
        rep.usage = obj["usage"]
    choices = obj.get("choices") or []
    if not choices:
        return  # the usage-only chunk
    n = 0
    for ch in choices:
        if ch.get("finish_reason"):
            rep.finish[ch.get("index", 0)] = ch["finish_reason"]
        text = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
        rep.text += text
        tokens = (ch.get("logprobs") or {}).get("tokens")
        n += len(tokens) if tokens is not None else int(bool(text))
    rep.times.append(now)
    rep.counts.append(n)
    if (n or not full) and not rep.first:
        rep.first = now


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run on uvloop when it is installed (Ray brings it): the client
    shares the cores with the server, so its own loop overhead counts."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def loopback_only(url: str) -> None:
    """Refuse to load anything but this machine (SystemExit otherwise)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit(f"refusing to load {host}: loopback targets only")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header for ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_name(url: str, api_key: str | None = None) -> str | None:
    """The first model the server lists (None when /v1/models fails)."""
    import httpx

    r = httpx.get(f"{url}/v1/models", headers=auth_headers(api_key), timeout=30)
    return r.json()["data"][0]["id"] if r.status_code == 200 else None


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics' conveyor:* series, summed over their labels."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30).text.splitlines():
        if line.startswith("conveyor:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out
