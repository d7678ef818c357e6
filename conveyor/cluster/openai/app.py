"""The ASGI app over one OpenAIServer: routes, error handlers and middleware
order. Usable without Serve (tests, tests/compat); Serve mounts the same app
(conveyor/cluster/serve_app.py)."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import WebSocketRoute

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import protocol as P
from conveyor.cluster.openai.http import error_response, meta_of, to_response
from conveyor.cluster.openai.job import Reply, RequestMeta
from conveyor.cluster.openai.metrics import CONTENT_TYPE
from conveyor.cluster.openai.middleware import AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from conveyor.cluster.openai.responses_api.routes import add_responses_routes
from conveyor.cluster.openai.routes import lora as lora_routes
from conveyor.cluster.openai.routes.admin import add_admin_routes
from conveyor.cluster.openai.routes.utility import add_utility_routes
from conveyor.cluster.openai.server import OpenAIServer
from conveyor.engine.config import ServeConfig
from conveyor.engine.errors import EngineDeadError, UnsendableRequestError

log = logging.getLogger("conveyor.cluster.openai.app")

# Documented instead of FastAPI's 422: every client error has the OpenAI shape.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": E.ErrorResponse, "description": "OpenAI-shaped client error"},
    "5XX": {"model": E.ErrorResponse, "description": "OpenAI-shaped server error"}}



def build_api(server: OpenAIServer, *, api_key: str | None, echo_request_id: bool = True) -> FastAPI:
    """echo_request_id: False behind Serve, whose proxy already sets and echoes
    X-Request-Id (a second header would duplicate it)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await server.start()
        yield

    # /openapi.json is not a public path: behind the API key when one is set.
    # strict_content_type=False: a body sent without Content-Type is read as
    # JSON (raw clients); another Content-Type is a 415.
    app = FastAPI(title="Conveyor", version="v1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan, strict_content_type=False)
    _add_generation_routes(app, server)
    lora_routes.add_routes(app, lambda: server.llm.frontend.loras, guarded, _ERROR_RESPONSES)
    add_utility_routes(app, server, guarded, _ERROR_RESPONSES)
    add_responses_routes(app, server, guarded, _ERROR_RESPONSES)
    add_admin_routes(app, server, guarded, _ERROR_RESPONSES)
    _add_probe_routes(app, server)
    _add_error_handlers(app)
    _add_middleware(app, server.config.serve, api_key, echo_request_id)
    return app


async def guarded(call: Awaitable[Response]) -> Response:
    """Await a route's work; any error becomes its OpenAI-shaped response."""
    try:
        return await call
    except E.APIError as e:
        return error_response(e)
    except EngineDeadError:  # it died under a running request
        return error_response(E.engine_unavailable())
    except UnsendableRequestError as e:  # this request alone: the engine goes on
        return error_response(E.bad_request(str(e)))
    except Exception:
        log.exception("request failed")
        return error_response(E.internal_error())


async def _reply(handler: Callable[[Any, RequestMeta], Awaitable[Reply]], body: Any,
                 request: Request) -> Response:
    return to_response(await handler(body, meta_of(request)))


def _add_generation_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await guarded(_reply(server.completions, body, request))

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat(body: P.ChatRequest, request: Request) -> Response:
        return await guarded(_reply(server.chat, body, request))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()


def _add_probe_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/health")
    async def health() -> Response:
        try:
            return JSONResponse(await server.health())
        except E.APIError as e:
            return error_response(e)

    @app.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400: FastAPI could not read the body (e.g. not UTF-8).
        code = {400: "invalid_json", 404: "not_found",
                405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(E.APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's 422 becomes OpenAI's 400 naming the field (`param`).
        return error_response(E.invalid_request(exc.errors()))


def _add_middleware(app: FastAPI, cfg: ServeConfig, api_key: str | None, echo_request_id: bool) -> None:
    """After every route is added (auth reads which connection kinds they take)."""
    public = {"/health", "/live"} | ({"/metrics"} if cfg.metrics_public else set())
    # add_middleware: the last added runs first. Order seen by a request:
    # [request id] -> [CORS] -> auth -> body limit -> routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    # Only the connection kinds a route declares get past auth (no websocket otherwise).
    kinds = frozenset({"http"} | ({"websocket"} if any(isinstance(r, WebSocketRoute)
                                                          for r in app.routes) else set()))
    app.add_middleware(AuthMiddleware, api_key=api_key, public_paths=frozenset(public),
                       scope_types=kinds)
    if cfg.cors_origins:
        # Bearer keys, not cookies: credentials stay off, so "*" is never combined with them.
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                           allow_credentials=False, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    if echo_request_id:
        app.add_middleware(RequestIdMiddleware)
