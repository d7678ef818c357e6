"""Issue 26's HTTP acceptance: 32 concurrent streams on a data-parallel app
(greedy; seeded at temperature 0.8; JSON-schema; a forced tool call; n=2 with
stop strings and logprobs), disrupted once every stream has its first event.
Each stream's summary (per choice: text, tool calls, finish reason, logprob
tokens and values) is compared with an undisturbed run of the same app."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from sse_utils import DONE, sse_events

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
    "type": "string", "minLength": 3, "maxLength": 6}}}, "required": ["tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
WORDS = ["The cat runs", "A dog sees the ball", "My friend builds", "Rain falls on", "Once upon a time"]
TOKENS = 24


def bodies(stop: str) -> list[tuple[str, dict[str, Any]]]:
    """32 (route, body) pairs: 8 greedy, 8 seeded, 6 JSON-schema, 5 forced
    tool calls, 5 n=2 with a stop string and logprobs."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(8):
        out.append(("/v1/completions", {"prompt": f"{WORDS[i % 5]} {i}", "max_tokens": TOKENS,
                                        "ignore_eos": True, "temperature": 0.0, "logprobs": 0}))
    for i in range(8):
        out.append(("/v1/completions", {"prompt": f"{WORDS[i % 5]} {i}", "max_tokens": TOKENS,
                                        "ignore_eos": True, "temperature": 0.8, "seed": 100 + i,
                                        "logprobs": 0}))
    for i in range(6):
        out.append(("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Tags for {WORDS[i % 5]}"}], "max_tokens": 80,
            "temperature": 0.8, "seed": 200 + i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TAGS}}}))
    for i in range(5):
        out.append(("/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Weather {i}?"}], "tools": TOOLS, "max_tokens": 80,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0.8, "seed": 300 + i}))
    for i in range(5):
        out.append(("/v1/completions", {"prompt": f"{WORDS[i % 5]} and {i}", "max_tokens": TOKENS, "n": 2,
                                        "ignore_eos": True, "temperature": 0.8, "seed": 400 + i,
                                        "stop": [stop], "logprobs": 1}))
    return out


def _absorb(acc: dict[int, dict[str, Any]], ev: dict[str, Any]) -> None:
    for ch in ev.get("choices") or []:
        c = acc.setdefault(ch["index"], {"text": "", "tools": {}, "finish": None, "tokens": [], "lps": []})
        delta = ch.get("delta")
        c["text"] += (delta.get("content") or "") if delta is not None else ch.get("text") or ""
        for tc in (delta or {}).get("tool_calls") or []:
            t = c["tools"].setdefault(tc["index"], {"name": "", "arguments": ""})
            fn = tc.get("function") or {}
            t["name"] += fn.get("name") or ""
            t["arguments"] += fn.get("arguments") or ""
        c["finish"] = ch.get("finish_reason") or c["finish"]
        lp = ch.get("logprobs") or {}
        c["tokens"] += lp.get("tokens") or []
        c["lps"] += lp.get("token_logprobs") or []


async def _stream(c: httpx.AsyncClient, route: str, body: dict[str, Any],
                  started: asyncio.Event) -> dict[str, Any]:
    acc: dict[int, dict[str, Any]] = {}
    done, errors = False, []
    async for ev in sse_events(c, route, {"model": "tiny", "stream": True, **body}):
        if ev is DONE:
            done = True
            continue
        if "error" in ev:
            errors.append(ev)
        _absorb(acc, ev)
        started.set()
    started.set()
    return {"choices": acc, "done": done, "errors": errors}


async def run_streams(url: str, headers: dict[str, str], pairs: list[tuple[str, dict[str, Any]]],
                      disrupt: Callable[[httpx.AsyncClient], Awaitable[None]] | None = None,
                      at_once: bool = False) -> list[dict[str, Any]]:
    """Every stream's summary; `disrupt` runs once each has its first event
    (at_once: as soon as the streams are sent; it waits for what it needs)."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=180) as c:
        started = [asyncio.Event() for _ in pairs]
        tasks = [asyncio.create_task(_stream(c, r, b, s)) for (r, b), s in zip(pairs, started)]
        if not at_once:
            await asyncio.gather(*(s.wait() for s in started))
        if disrupt is not None:
            await disrupt(c)
        return await asyncio.gather(*tasks)


def diff(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str | None:
    """None when each stream ended [DONE] without an error event and matches
    the reference: text, tool calls, finish reasons and logprob tokens
    exactly, logprob values to 1e-4 (a migrated context is computed in one
    prefill, not token by token)."""
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if not g["done"] or g["errors"]:
            return f"stream {i}: done={g['done']} errors={g['errors']}"
        if g["choices"].keys() != r["choices"].keys():
            return f"stream {i}: choices {sorted(g['choices'])} != {sorted(r['choices'])}"
        for k, rc in r["choices"].items():
            gc = g["choices"][k]
            for key in ("text", "tools", "finish", "tokens"):
                if gc[key] != rc[key]:
                    return f"stream {i} choice {k} {key}: {gc[key]!r} != {rc[key]!r}"
            if len(gc["lps"]) != len(rc["lps"]) or any(
                    abs(a - b) > 1e-4 for a, b in zip(gc["lps"], rc["lps"])):
                return f"stream {i} choice {k} logprobs differ"
    return None
