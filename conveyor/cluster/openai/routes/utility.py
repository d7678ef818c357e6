"""Small routes beside the generation endpoints, in vLLM's shapes:
`GET /v1/models/{id}`, `POST /tokenize` (a prompt, or chat messages through
the chat template) and `POST /detokenize`.

Invariants: the same validation as the generation routes (unknown model ->
404 model_not_found; bad fields -> 400 naming them); nothing is queued.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import protocol as P
from conveyor.cluster.openai.server import OpenAIServer


class TokenizeRequest(P.StrictModel):
    """vLLM's: `prompt` (completions) or `messages` (chat template applied)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    tools: P.Tools = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # prompts only: messages get the template's own tokens
    return_token_strs: bool = False


class DetokenizeRequest(P.StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def _tokenize(server: OpenAIServer, req: TokenizeRequest) -> dict[str, Any]:
    server.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise E.bad_request("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        try:
            chat = P.ChatRequest(messages=req.messages, tools=req.tools,
                                 add_generation_prompt=req.add_generation_prompt)
        except ValidationError as e:  # e.g. messages: [] (a chat needs at least one)
            raise E.invalid_request(e.errors()) from None
        ids = server.chat_prompt(chat)  # the template holds its special tokens (as chat runs it)
    else:
        ids = server.tokenize(req.prompt or "", req.add_special_tokens, "prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": server.config.max_model_len,
                           "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [server.fmt.token(t) for t in ids]
    return out


def _detokenize(server: OpenAIServer, req: DetokenizeRequest) -> dict[str, Any]:
    server.check_model(req.model)
    tok = server.llm.tokenizer
    if tok is None:
        raise E.bad_request("this model has no tokenizer", "tokens")
    vocab = server.llm.frontend.vocab_size or len(tok)
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise E.bad_request(f"tokens must be in [0, {vocab})", "tokens")
    return {"prompt": tok.decode(req.tokens)}


def add_utility_routes(app: FastAPI, server: OpenAIServer, guarded: Callable[[Any], Any],
                       responses: dict[int | str, dict[str, Any]]) -> None:
    """guarded: build_api's wrapper that turns APIError into the OpenAI body."""

    async def as_json(fn: Callable[[], dict[str, Any]]) -> Response:
        return JSONResponse(fn())

    @app.get("/v1/models/{model_id:path}", responses=responses)
    async def model(model_id: str) -> Response:
        def card() -> dict[str, Any]:
            server.check_model(model_id)
            return server.models()["data"][0]
        return await guarded(as_json(card))

    @app.post("/tokenize", responses=responses)
    async def tokenize(body: TokenizeRequest) -> Response:
        return await guarded(as_json(lambda: _tokenize(server, body)))

    @app.post("/detokenize", responses=responses)
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await guarded(as_json(lambda: _detokenize(server, body)))
