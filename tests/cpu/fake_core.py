"""FakeCore, the fake engine client (fake_engines.py) as AsyncLLM's one
engine, and the in-process OpenAI app over it.

FakeCore is fake_engines.FakeEngineClient (the tests' one CoreClient without
an engine) with a pool that fits any test prompt, the tiny tokenizer's
vocabulary, and two behaviours of its own: `finish` (each added request gets
FINISH_TOKEN and a length finish at once) and `fail_after` (that many adds
succeed, then the engine is dead). `emit` takes either EngineCoreOutputs, as
FakeEngineClient's does, or (request id, tokens, finish); `on_outputs` is
the handler `start` got; `added_event` is set on every add.

The app helpers drive AsyncLLM and the FastAPI app in process through httpx's
ASGI transport: no Ray, no socket, no weights (a model directory only lends
its tokenizer)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from fake_engines import FakeEngineClient

from conveyor.engine.config import build_config
from conveyor.engine.contracts import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    KVCacheInfo,
)
from conveyor.engine.errors import EngineDeadError

PROMPT = [5, 6, 7, 8]
FINISH_TOKEN = 11  # the one token `finish` emits


class FakeCore(FakeEngineClient):
    def __init__(self, config: Any = None, *, finish: bool = True, fail_after: int | None = None) -> None:
        super().__init__(config, vocab_size=512)
        self.kv_info = KVCacheInfo(num_blocks=1000, block_size=16, vocab_size=512)
        self.finish, self.fail_after = finish, fail_after
        self.added_event = asyncio.Event()  # clear it to wait for the next add

    # FakeEngineClient keeps the handler `start` got in `emit`; here it is
    # `on_outputs`, and `emit` also takes one request's tokens.
    @property
    def emit(self) -> Callable[..., None]:
        return self._emit

    @emit.setter
    def emit(self, handler: Callable[[EngineCoreOutputs], None] | None) -> None:
        self.on_outputs = handler

    def _emit(self, outs: EngineCoreOutputs | str, tokens: list[int] | None = None,
              finish: FinishReason | None = None) -> None:
        if not isinstance(outs, EngineCoreOutputs):
            outs = EngineCoreOutputs([EngineCoreOutput(outs, tokens or [], finish)])
        assert self.on_outputs is not None, "start() first"
        self.on_outputs(outs)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.fail_after is not None and len(self.added) >= self.fail_after:
            raise EngineDeadError("engine actor failed: ActorDiedError")
        super().add_request(request)
        self.added_event.set()
        if self.finish:
            self.emit(request.request_id, [FINISH_TOKEN], FinishReason.LENGTH)


# ---- the OpenAI app in process over a FakeCore ------------------------------------------

def run_bounded(coro: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
    """A bug here shows as a hang (a request that never ends): fail instead."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def engine_config(**kw: Any) -> Any:
    return build_config(max_model_len=256, **kw)


def fake_llm(core: FakeCore, model: str = "", **kw: Any) -> Any:
    """An AsyncLLM over `core`; `model` only lends its tokenizer."""
    from conveyor.engine.frontend.async_client import AsyncLLM

    return AsyncLLM(engine_config(model=model, **kw), core)


def app_client(llm: Any, **server_kw: Any) -> httpx.AsyncClient:
    """An httpx client of the OpenAI app over `llm` (no API key)."""
    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer

    srv = OpenAIServer(llm, llm.config, **server_kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(srv, api_key=None)),
                             base_url="http://t")


def error_body(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]
