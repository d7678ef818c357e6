"""`/v1/responses`: create (JSON or the typed event stream), retrieve, delete.

A Responses request runs as one chat request through OpenAIServer's own
pipeline (validation, template, tools, structured outputs, admission), and its
chat chunks are rewritten into Responses events:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      message: response.content_part.added, response.output_text.delta...,
               response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta...,
                     response.function_call_arguments.done
    response.output_item.done; then response.completed (or .incomplete when
    max_output_tokens cut it, .failed on an error).

Invariants:
- `sequence_number` counts every event of a stream from 0.
- A stored response (store, the default) is saved before its final event or
  JSON body goes out, so a client that got it can always retrieve it or
  continue from it with previous_response_id.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from conveyor.cluster.openai import bodies as B
from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import request_prep as RP
from conveyor.cluster.openai.http import meta_of, to_response
from conveyor.cluster.openai.job import Job, Reply, RequestMeta
from conveyor.cluster.openai.responses_api import protocol as R
from conveyor.cluster.openai.responses_api.store import LocalResponseStore, ResponseStore
from conveyor.cluster.openai.server import OpenAIServer

_DATA = b"data: "


def _not_found(rid: str, param: str | None = None) -> E.APIError:
    return E.APIError(404, f"Response with id {rid!r} not found.", code="response_not_found",
                      param=param)


class _EventWriter:
    """Chat chunks -> Responses events, for one streamed response."""

    def __init__(self, req: R.ResponsesRequest, rid: str, model: str) -> None:
        self.req, self.rid, self.model, self.created = req, rid, model, int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.usage: dict[str, int] | None = None
        self.finish: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n".encode() + B.sse(body)

    def response(self, status: str) -> dict[str, Any]:
        resp = R.response_object(self.req, self.rid, self.model, self.created, output=self.output,
                                 usage=self.usage, status=status)
        if status == "in_progress":
            resp["usage"], resp["completed_at"] = None, None
        return resp

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call(tc)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _text(self, text: str) -> list[bytes]:
        out = self._close_call()
        if self.msg is None:
            self.msg = R.message_item(R.new_id("msg"), None, "in_progress")
            self.output.append(self.msg)
            out += [self.event("response.output_item.added", output_index=len(self.output) - 1,
                               item=dict(self.msg, content=[])),
                    self.event("response.content_part.added", **self._where(self.msg),
                               content_index=0, part=R.output_text(""))]
            self.msg["content"] = [R.output_text("")]
        self.msg["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", **self._where(self.msg),
                                 content_index=0, delta=text, logprobs=[])]

    def _call(self, tc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        args = (tc.get("function") or {}).get("arguments") or ""
        if tc.get("id"):  # a new call
            out += self._close_message() + self._close_call()
            fn = tc.get("function") or {}
            self.call = R.call_item(R.new_id("fc"), tc["id"], fn.get("name", ""), "", "in_progress")
            self.output.append(self.call)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                  item=dict(self.call)))
        if args and self.call is not None:
            self.call["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", **self._where(self.call),
                                  delta=args))
        return out

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def final_status(self) -> str:
        return R.status_of(self.finish)

    def _close_message(self) -> list[bytes]:
        m, self.msg = self.msg, None
        if m is None:
            return []
        m["status"] = self.final_status()
        part = m["content"][0]
        return [self.event("response.output_text.done", **self._where(m), content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **self._where(m), content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.output.index(m), item=m)]

    def _close_call(self) -> list[bytes]:
        c, self.call = self.call, None
        if c is None:
            return []
        c["status"] = self.final_status()
        return [self.event("response.function_call_arguments.done", **self._where(c),
                           name=c["name"], arguments=c["arguments"]),
                self.event("response.output_item.done", output_index=self.output.index(c), item=c)]

    def close(self) -> list[bytes]:
        return self._close_message() + self._close_call()


class ResponsesAPI:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    @property
    def store(self) -> ResponseStore:
        if self.server.response_store is None:
            cfg = self.server.config.serve
            self.server.response_store = LocalResponseStore(cfg.responses_max_entries,
                                                            cfg.responses_ttl_s)
        return self.server.response_store

    async def create(self, req: R.ResponsesRequest, meta: RequestMeta) -> Reply:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            record = await self.store.get(req.previous_response_id)
            if record is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = record["messages"]
        chat, turns = R.chat_request(req, history)
        try:
            job = await RP.off_loop(self.server.prep_pool, self.server.chat_job, chat, meta)
        except E.APIError as e:
            raise R.responses_error(e) from None
        rid = R.new_id("resp")
        if req.stream:
            return self.server.stream(job, self._events(req, rid, job, turns))
        resp = R.from_chat(req, rid, self.server.model_name, await self.server.collect(job))
        await self._save(req, resp, turns)
        return resp

    async def _save(self, req: R.ResponsesRequest, resp: dict[str, Any],
                    turns: list[dict[str, Any]]) -> None:
        if not req.store:
            return
        out = R.output_turn(resp)
        await self.store.put(resp["id"], {"response": resp,
                                          "messages": turns + ([out] if out is not None else [])})

    async def _events(self, req: R.ResponsesRequest, rid: str, job: Job,
                      turns: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        ev = _EventWriter(req, rid, self.server.model_name)
        for b in ev.start():
            yield b
        # server.sse: the chat stream with errors in band and the engine
        # requests aborted however it ends (aclosing: also when we stop early).
        async with aclosing(self.server.sse(job)) as chunks:
            async for raw in chunks:
                if raw == B.SSE_DONE:
                    continue
                chunk = json.loads(raw[len(_DATA):])
                if "error" in chunk:
                    failed = ev.response("failed")
                    failed["error"] = {"code": chunk["error"].get("code"),
                                       "message": chunk["error"].get("message")}
                    yield ev.event("response.failed", response=failed)
                    return
                for b in ev.chunk(chunk):
                    yield b
        for b in ev.close():
            yield b
        status = ev.final_status()
        resp = ev.response(status)
        await self._save(req, resp, turns)
        yield ev.event(f"response.{status}", response=resp)

    async def retrieve(self, rid: str) -> dict[str, Any]:
        record = await self.store.get(rid)
        if record is None:
            raise _not_found(rid)
        return record["response"]

    async def delete(self, rid: str) -> dict[str, Any]:
        if not await self.store.delete(rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}


def add_responses_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                         responses: dict[int | str, dict[str, Any]]) -> None:
    """guarded: build_api's wrapper that turns APIError into the OpenAI body."""
    api = ResponsesAPI(server)

    async def reply(call: Awaitable[Reply]) -> Response:
        return to_response(await call)

    @app.post("/v1/responses", responses=responses)
    async def create(body: R.ResponsesRequest, request: Request) -> Response:
        return await guarded(reply(api.create(body, meta_of(request))))

    @app.get("/v1/responses/{response_id}", responses=responses)
    async def retrieve(response_id: str) -> Response:
        return await guarded(reply(api.retrieve(response_id)))

    @app.delete("/v1/responses/{response_id}", responses=responses)
    async def delete(response_id: str) -> Response:
        return await guarded(reply(api.delete(response_id)))
