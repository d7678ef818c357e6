"""Pure-ASGI middlewares of the OpenAI app: API-key auth, body-size limit and
request ids.

Auth decides by the raw ASGI path (relative to root_path), never by route
matching, so a path that matches no route, a new route, or an odd spelling
still needs the key; only the exact public paths pass without one.
"""
from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str, type_: str, code: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


def relative_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


WS_POLICY_VIOLATION = 1008


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every path but `public_paths`; no key
    configured -> no auth. Constant-time comparison.

    Connection kinds: "http" always; "websocket" only when in `scope_types`
    (a route declares it), and then behind the same key; any other kind is
    refused before the app sees it. "lifespan" (the server's own start/stop
    events, no client) always passes."""

    def __init__(self, app: ASGIApp, api_key: str | None, public_paths: frozenset[str],
                 scope_types: frozenset[str] = frozenset({"http"})) -> None:
        self.app, self.public, self.scope_types = app, public_paths, scope_types | {"http"}
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind not in self.scope_types:
            await _refuse(kind, send)
            return
        if self.key is None or relative_path(scope) in self.public or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if kind != "http":
            await _refuse(kind, send)
            return
        await send_error(send, 401, "Incorrect API key provided.", "invalid_request_error",
                         "invalid_api_key", [(b"www-authenticate", b"Bearer")])

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


async def _refuse(kind: str, send: Send) -> None:
    """A websocket is closed before it is accepted (the client sees 403);
    other kinds get nothing at all."""
    if kind == "websocket":
        await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION})


class BodyLimitMiddleware:
    """413 when Content-Length or the bytes actually received exceed max_bytes.
    The body is read here (bounded) and replayed to the app; after it, the
    app's receive() reaches the real channel again, so a streaming response
    still hears http.disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await send_error(send, 400, "invalid Content-Length", "invalid_request_error",
                                 "invalid_value")
                return
            if n > self.max:
                await self._too_large(send)
                return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"request body exceeds {self.max} bytes",
                         "invalid_request_error", "request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class RequestIdMiddleware:
    """Outside Serve only (Serve's proxy does the same): make sure the request
    has an X-Request-Id and echo it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _header(scope, b"x-request-id")
        if rid is None:
            rid = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope.get("headers", ()), (b"x-request-id", rid)]}

        async def send_with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), (b"x-request-id", rid)]}
            await send(msg)

        await self.app(scope, receive, send_with_id)
