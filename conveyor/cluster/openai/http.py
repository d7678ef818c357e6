"""The HTTP edge of the handlers: a starlette Request into RequestMeta, and a
Reply (data) or an APIError into a starlette Response. The only place where
handlers' data meets HTTP types."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor.cluster.openai.errors import APIError
from conveyor.cluster.openai.job import EventStream, Reply, RequestMeta

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def meta_of(request: Request) -> RequestMeta:
    """The request id as sent (Serve's proxy, or RequestIdMiddleware, sets one
    when the client did not); the server checks its form."""
    return RequestMeta(request.headers.get("x-request-id", ""), request.headers.get("x-session-id"))


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def to_response(reply: Reply) -> Response:
    if isinstance(reply, EventStream):
        return ReleasingStream(reply.chunks, reply.release, media_type="text/event-stream",
                               headers=_SSE_HEADERS)
    return JSONResponse(reply)


class ReleasingStream(StreamingResponse):
    """A streaming response that calls `release` once it is over, however it
    ends (finished, failed, client gone): an admission slot is never leaked."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release_slot = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release_slot()
