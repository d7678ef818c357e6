"""Admin routes over a data-parallel replica's engines, beside drain/undrain
(conveyor/cluster/openai/routes/admin.py) and behind the same API key:

- `GET /admin/engines`: each engine's slot, state (up, drained, lost, dead)
  and process ids (the EngineCoreActor's and its workers');
- `POST /admin/replace {"engine": I}`: start a new engine in slot I, its
  requests moved to the others first when it is up (DataParallelClient.
  replace_engine): a dead engine (restart budget spent) comes back, or a
  drained one restarts; no stream breaks.

Invariant: the body is checked once here (engine an int in range, timeout
finite and bounded); a replica with one engine answers 400 naming `engine`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.cluster.openai import errors as P
from conveyor.cluster.openai.routes.admin import MAX_DRAIN_TIMEOUT_S

if TYPE_CHECKING:
    from conveyor.cluster.openai.server import OpenAIServer


class ReplaceRequest(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    engine: int = Field(ge=0, le=1 << 16)
    timeout_s: float = Field(default=60.0, gt=0.0, le=MAX_DRAIN_TIMEOUT_S)


def _dp(server: OpenAIServer) -> Any:
    dp = server.llm.client
    if not hasattr(dp, "replace_engine"):
        raise P.bad_request("this server has one engine (parallel.data_parallel_size 1)", "engine")
    return dp


def add_engine_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                      responses: dict[int | str, dict[str, Any]]) -> None:
    async def engines_call() -> Response:
        dp = _dp(server)
        return JSONResponse({"engines": await asyncio.get_running_loop().run_in_executor(None, dp.engines)})

    async def replace_call(body: ReplaceRequest) -> Response:
        dp = _dp(server)
        loop = asyncio.get_running_loop()
        try:
            moved = await loop.run_in_executor(None, dp.replace_engine, body.engine, None, body.timeout_s)
        except ValueError as e:
            raise P.bad_request(str(e), "engine") from None
        except TimeoutError as e:
            raise P.APIError(504, str(e), type="server_error", code="drain_timeout") from None
        return JSONResponse({"engine": body.engine, "status": "up", "moved_requests": moved})

    @app.get("/admin/engines", responses=responses)
    async def engines() -> Response:
        return await guarded(engines_call())

    @app.post("/admin/replace", responses=responses)
    async def replace(body: ReplaceRequest) -> Response:
        return await guarded(replace_call(body))
