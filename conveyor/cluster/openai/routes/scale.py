"""Admin routes that change a data-parallel replica's engines, behind the API
key like the other admin routes (conveyor/cluster/openai/routes/admin.py):

- `POST /admin/reload {"timeout_s"?}`: read the replica's config file again
  and apply it (DataParallelClient.reload, conveyor/engine/dp/scaling.py): changed engine
  settings roll out engine by engine, each engine's requests migrating first;
  changed autoscaling knobs apply at once. A changed model, or a key the
  frontend was built with, is a 400 naming the keys (nothing changes).
- `POST /admin/scale {"engines": N, "timeout_s"?}`: add or remove engines
  until N are up (a removed engine is drained through migration first).

Invariant: the body is checked once here (ints and finite timeouts in
bounds); a replica with one engine answers 400.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from conveyor.cluster.openai import errors as E

if TYPE_CHECKING:
    from conveyor.cluster.openai.server import OpenAIServer

MAX_TIMEOUT_S = 3600.0


class ReloadRequest(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_TIMEOUT_S)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    engines: int = Field(ge=1, le=1024)
    timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_TIMEOUT_S)


def _dp(server: OpenAIServer, param: str) -> Any:
    dp = server.llm.client
    if not hasattr(dp, "reload"):
        raise E.bad_request("this server has one engine (parallel.data_parallel_size 1)", param)
    return dp


async def _call(fn: Callable[..., Any], *args: Any, param: str) -> Any:
    """fn(*args) off the event loop; its ValueError is the client's 400, a timeout a 504."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except ValueError as e:
        raise E.bad_request(str(e), param) from None
    except TimeoutError as e:
        raise E.APIError(504, str(e), type="server_error", code="drain_timeout") from None


def add_scale_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                     responses: dict[int | str, dict[str, Any]]) -> None:
    async def reload_call(body: ReloadRequest) -> Response:
        dp = _dp(server, "config")
        return JSONResponse(await _call(dp.reload, None, body.timeout_s, param="config"))

    async def scale_call(body: ScaleRequest) -> Response:
        dp = _dp(server, "engines")
        moved = await _call(dp.scale_to, body.engines, body.timeout_s, param="engines")
        return JSONResponse({"engines": dp.engine_count(), "moved_requests": moved})

    @app.post("/admin/reload", responses=responses)
    async def reload(body: ReloadRequest | None = None) -> Response:
        return await guarded(reload_call(body or ReloadRequest()))

    @app.post("/admin/scale", responses=responses)
    async def scale(body: ScaleRequest) -> Response:
        return await guarded(scale_call(body))
