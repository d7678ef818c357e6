"""Admin routes over a replica's engines (data parallel), behind the API key
like every non-public path (set serve.api_key_env: without a key the admin
routes are as open as the API). Each one calls the client's FleetAdmin
(conveyor/engine/core_client.py):

- `POST /admin/drain {"engine", "timeout_s"?}`: move every request off one
  engine to the others (streams go on without a break); answers once that
  engine holds none. `POST /admin/undrain {"engine"}`: it takes requests again.
- `GET /admin/engines`: each engine's slot, state (up, drained, lost, dead,
  off) and process ids (the EngineCoreActor's and its workers').
- `POST /admin/replace {"engine", "timeout_s"?}`: a new engine in slot I, its
  requests moved to the others first when it is up; a dead engine comes
  back, a drained one restarts; no stream breaks.
- `POST /admin/reload {"timeout_s"?}`: read the replica's config file again
  and apply it (conveyor/engine/dp/scaling.py): changed engine settings roll
  out engine by engine; changed autoscaling knobs apply at once. A changed
  model, or a key the frontend was built with, is a 400 naming the keys.
- `POST /admin/scale {"engines", "timeout_s"?}`: add or remove engines until
  N are up (a removed engine is drained through migration first).

Invariants: the body is checked once here (ints and finite timeouts in
bounds); a replica with one engine answers 400 with NOT_DATA_PARALLEL; the
fleet's ValueError is a 400 naming the field, a TimeoutError a 504.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai.server import OpenAIServer
from conveyor.engine.core_client import NOT_DATA_PARALLEL, FleetAdmin

MAX_TIMEOUT_S = 3600.0
MAX_ENGINE = 1 << 16
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class DrainRequest(BaseModel):
    model_config = _STRICT
    engine: int = Field(ge=0, le=MAX_ENGINE)
    timeout_s: float = Field(default=60.0, gt=0.0, le=MAX_TIMEOUT_S)


class UndrainRequest(BaseModel):
    model_config = _STRICT
    engine: int = Field(ge=0, le=MAX_ENGINE)


class ReplaceRequest(DrainRequest):
    pass


class ReloadRequest(BaseModel):
    model_config = _STRICT
    timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_TIMEOUT_S)


class ScaleRequest(BaseModel):
    model_config = _STRICT
    engines: int = Field(ge=1, le=1024)
    timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_TIMEOUT_S)


def _admin(server: OpenAIServer, param: str) -> FleetAdmin:
    admin = server.llm.client.admin
    if admin is None:
        raise E.bad_request(NOT_DATA_PARALLEL, param)
    return admin


async def _call(fn: Callable[..., Any], *args: Any, param: str) -> Any:
    """fn(*args) off the event loop; its ValueError is the client's 400, a timeout a 504."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except ValueError as e:
        raise E.bad_request(str(e), param) from None
    except TimeoutError as e:
        raise E.APIError(504, str(e), type="server_error", code="drain_timeout") from None


def add_admin_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                     responses: dict[int | str, dict[str, Any]]) -> None:
    """guarded: build_api's wrapper that turns APIError into the OpenAI body."""

    async def drain_call(body: DrainRequest) -> Response:
        moved = await _call(_admin(server, "engine").drain, body.engine, body.timeout_s, param="engine")
        return JSONResponse({"engine": body.engine, "status": "drained", "moved_requests": moved})

    async def undrain_call(body: UndrainRequest) -> Response:
        await _call(_admin(server, "engine").undrain, body.engine, param="engine")
        return JSONResponse({"engine": body.engine, "status": "up"})

    async def engines_call() -> Response:
        return JSONResponse({"engines": await _call(_admin(server, "engine").engines, param="engine")})

    async def replace_call(body: ReplaceRequest) -> Response:
        admin = _admin(server, "engine")
        moved = await _call(admin.replace_engine, body.engine, None, body.timeout_s, param="engine")
        return JSONResponse({"engine": body.engine, "status": "up", "moved_requests": moved})

    async def reload_call(body: ReloadRequest) -> Response:
        return JSONResponse(await _call(_admin(server, "config").reload, None, body.timeout_s, param="config"))

    async def scale_call(body: ScaleRequest) -> Response:
        admin = _admin(server, "engines")
        moved = await _call(admin.scale_to, body.engines, body.timeout_s, param="engines")
        return JSONResponse({"engines": admin.engine_count(), "moved_requests": moved})

    @app.post("/admin/drain", responses=responses)
    async def drain(body: DrainRequest) -> Response:
        return await guarded(drain_call(body))

    @app.post("/admin/undrain", responses=responses)
    async def undrain(body: UndrainRequest) -> Response:
        return await guarded(undrain_call(body))

    @app.get("/admin/engines", responses=responses)
    async def engines() -> Response:
        return await guarded(engines_call())

    @app.post("/admin/replace", responses=responses)
    async def replace(body: ReplaceRequest) -> Response:
        return await guarded(replace_call(body))

    @app.post("/admin/reload", responses=responses)
    async def reload(body: ReloadRequest | None = None) -> Response:
        return await guarded(reload_call(body or ReloadRequest()))

    @app.post("/admin/scale", responses=responses)
    async def scale(body: ScaleRequest) -> Response:
        return await guarded(scale_call(body))
