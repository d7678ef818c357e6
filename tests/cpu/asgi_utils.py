"""One in-process OpenAI app for a test module (no Ray, no sockets): an AsyncLLM
and its FastAPI app on one event loop, driven through httpx's ASGI transport."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx

# (event loop, FastAPI app, AsyncLLM)
Api = tuple[asyncio.AbstractEventLoop, Any, Any]


def in_process_api(ckpt: str, max_model_len: int) -> Iterator[Api]:
    """A module fixture's body: yields (loop, app, llm), shuts the engine down after."""
    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    cfg = build_config({"model": {"path": ckpt, "max_model_len": max_model_len},
                        "serve": {"served_model_name": "tiny"}})
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(cfg)
    srv = OpenAIServer(llm, cfg)
    app = build_api(srv, api_key=None)
    loop.run_until_complete(srv.start())
    yield loop, app, llm
    loop.run_until_complete(llm.shutdown())
    loop.close()


def run_on(loop: asyncio.AbstractEventLoop, app: Any,
           coro_fn: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    """coro_fn(client) on the app's loop, with a client bound to the app."""
    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=60) as c:
            return await coro_fn(c)
    return loop.run_until_complete(go())


def openai_client(c: httpx.AsyncClient) -> Any:
    """The official async client over an ASGI-bound httpx client."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=c, max_retries=0)
