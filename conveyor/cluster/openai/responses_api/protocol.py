"""OpenAI Responses API (`/v1/responses`) wire format: the request model, its
translation into a chat request (so one pipeline validates, renders and runs
both APIs), and the Response object built from a chat completion.

Invariants:
- A Responses request becomes exactly one ChatRequest: `instructions` -> a
  system turn first; the stored conversation of `previous_response_id` (its
  input and output, tool calls included, never its instructions, as OpenAI)
  -> the turns before `input`; function_call / function_call_output items ->
  assistant tool calls / tool turns; `text.format` -> response_format.
- Client mistakes are 400s naming the Responses field (`input`, `tools`,
  `text`, `max_output_tokens`, ...), never the chat field it became.
"""
from __future__ import annotations

import secrets
import time
from typing import Any

from conveyor.cluster.openai import bodies as B
from conveyor.cluster.openai import errors as E
from conveyor.cluster.openai import protocol as P

_TEXT_PARTS = ("input_text", "output_text", "text")
# chat field -> the Responses field a client sent
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesRequest(P.StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- request -> chat ---------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise E.bad_request(f"{where}.content must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise E.bad_request(f"{where}.content[{j}]: only text parts are supported "
                                f"({', '.join(_TEXT_PARTS)}); got {kind!r}", "input",
                                "unsupported_parameter")
        out.append(part["text"])
    return "".join(out)


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text, or, when it holds
    input_image parts, chat parts in order (images as image_url parts, which
    the chat path checks, loads and refuses like any other)."""
    if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise E.bad_request(f"{where}.content[{j}]: input_image needs image_url (a data: or "
                                    "http(s) URL; file_id is not supported)", "input", "unsupported_parameter")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}.content[{j}]")})
    return parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input -> chat messages (consecutive calls join one assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise E.bad_request(f"{where}.role must be user, system, developer or assistant", "input")
            msgs.append({"role": role, "content": _content_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else _text_of(out, where)})
        elif kind != "reasoning":  # reasoning items carry nothing this model reads
            raise E.bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                                "function_call_output)", "input", "unsupported_parameter")
    return msgs


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise E.bad_request(f"tools[{i}]: only function tools are supported", "tools",
                                "unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(tc: Any) -> Any:
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise E.bad_request("text.format must be an object", "text")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return {"type": fmt.get("type")}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[P.ChatRequest,
                                                                                 list[dict[str, Any]]]:
    """(the chat request, the conversation to store: history + this input)."""
    turns = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model, "messages": system + turns, "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "seed": req.seed, "stream": req.stream, "user": req.user}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return E.validate_model(P.ChatRequest, {k: v for k, v in body.items() if v is not None}), turns
    except E.APIError as e:
        raise responses_error(e) from None


def responses_error(e: E.APIError) -> E.APIError:
    """A chat pipeline error with `param` named as the Responses client sent it."""
    if e.param in _PARAM_NAMES:
        e.param = _PARAM_NAMES[e.param]
    return e


# ---- chat completion -> Response ---------------------------------------------------------

def output_items(content: str | None, tool_calls: list[dict[str, Any]], done: bool = True
                 ) -> list[dict[str, Any]]:
    status = "completed" if done else "incomplete"
    items: list[dict[str, Any]] = []
    if content:
        items.append(message_item(new_id("msg"), content, status))
    for tc in tool_calls:
        items.append(call_item(new_id("fc"), tc["id"], tc["function"]["name"],
                               tc["function"]["arguments"], status))
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, *,
                    output: list[dict[str, Any]], usage: dict[str, int] | None,
                    status: str = "completed") -> dict[str, Any]:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    u = usage or B.usage(0, 0)
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "temperature": req.temperature,
        "top_p": req.top_p, "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "store": req.store, "metadata": req.metadata or {},
        "user": req.user, "truncation": "disabled", "completed_at": int(time.time()),
        "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                  "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}}}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_chat(req: ResponsesRequest, rid: str, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat completion -> the Response."""
    choice = chat["choices"][0]
    msg, status = choice["message"], status_of(choice["finish_reason"])
    items = output_items(msg.get("content"), msg.get("tool_calls") or [], status == "completed")
    return response_object(req, rid, model, chat["created"], output=items, usage=chat.get("usage"),
                           status=status)


def output_turn(response: dict[str, Any]) -> dict[str, Any] | None:
    """The Response's output as the assistant turn a follow-up sees (tool calls included)."""
    text = "".join(p["text"] for it in response["output"] if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in response["output"] if it["type"] == "function_call"]
    if not text and not calls:
        return None
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn
