"""Admin routes of a data-parallel replica: `POST /admin/drain` moves every
request off one engine to the others (streams go on without a break) and
answers once that engine holds none; `POST /admin/undrain` lets it take
requests again. Behind the API key like every non-public path (set
serve.api_key_env: without a key the admin routes are as open as the API).

Invariants: the body is checked once here (engine an int in range, timeout
finite and bounded); a replica with one engine answers 400 naming `engine`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai.server import OpenAIServer

MAX_DRAIN_TIMEOUT_S = 3600.0


class DrainRequest(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    engine: int = Field(ge=0, le=1 << 16)
    timeout_s: float = Field(default=60.0, gt=0.0, le=MAX_DRAIN_TIMEOUT_S)


class UndrainRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    engine: int = Field(ge=0, le=1 << 16)


def add_admin_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                     responses: dict[int | str, dict[str, Any]]) -> None:
    """guarded: build_api's wrapper that turns APIError into the OpenAI body."""

    async def drain_call(body: DrainRequest) -> Response:
        try:
            moved = await server.llm.drain(body.engine, body.timeout_s)
        except ValueError as e:
            raise E.bad_request(str(e), "engine") from None
        except TimeoutError as e:
            raise E.APIError(504, str(e), type="server_error", code="drain_timeout") from None
        return JSONResponse({"engine": body.engine, "status": "drained", "moved_requests": moved})

    async def undrain_call(body: UndrainRequest) -> Response:
        try:
            server.llm.undrain(body.engine)
        except ValueError as e:
            raise E.bad_request(str(e), "engine") from None
        return JSONResponse({"engine": body.engine, "status": "up"})

    @app.post("/admin/drain", responses=responses)
    async def drain(body: DrainRequest) -> Response:
        return await guarded(drain_call(body))

    @app.post("/admin/undrain", responses=responses)
    async def undrain(body: UndrainRequest) -> Response:
        return await guarded(undrain_call(body))

    from conveyor.cluster.openai.routes.engines import add_engine_routes

    add_engine_routes(app, server, guarded, responses)
