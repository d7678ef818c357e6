"""Reading an OpenAI stream over HTTP: the events of one streamed POST."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

# What sse_events yields for `data: [DONE]` (compare with `is`).
DONE: dict[str, Any] = {"[DONE]": True}


async def sse_events(c: httpx.AsyncClient, route: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to `route` (asserting 200) and yield each `data:` event
    parsed, DONE for the terminal `[DONE]`; other SSE lines are skipped."""
    async with c.stream("POST", route, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                yield DONE
            elif line.startswith("data: "):
                yield json.loads(line[6:])
