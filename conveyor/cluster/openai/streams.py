"""Interleaving a request's engine streams (one per prompt) for the HTTP layer."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from conveyor.engine.frontend.output_processor import RequestOutput


async def merge_streams(gens: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Interleave engine streams. Yields every delta that is ready as one
    batch of (prompt index, delta), in arrival order: a consumer that falls
    behind the engine takes several steps at once (fewer, larger SSE events
    under load) instead of falling further behind. Closing this generator (or
    cancelling its consumer) closes every engine stream, which aborts them."""
    if len(gens) == 1:  # the common case: no pump task, no second queue
        try:
            async for ro in gens[0]:
                yield [(0, ro)]
        finally:
            await gens[0].aclose()
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async for ro in g:
                q.put_nowait((i, ro))
            q.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            batch = []
            for i, item in items:
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    batch.append((i, item))
            if batch:
                yield batch
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
