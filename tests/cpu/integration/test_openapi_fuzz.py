"""The published OpenAPI schema, fuzzed with schemathesis.

One in-process server (uvicorn on 127.0.0.1, one event loop, a tiny
checkpoint, no Ray). Every operation of /openapi.json gets a bounded number
of schema-valid and schema-violating requests: none may answer 5xx, every 4xx
has the OpenAI error shape, and the engine is healthy and idle afterwards."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest

from conveyor.parallel.ports import free_port

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Per operation and generation mode: keeps the run to seconds. A longer hunt:
# CONVEYOR_FUZZ_EXAMPLES=250 (random instead of derandomized examples).
EXAMPLES_PER_MODE = int(os.environ.get("CONVEYOR_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = "CONVEYOR_FUZZ_EXAMPLES" not in os.environ


@pytest.fixture(scope="module")
def served(tiny_llama):
    """(base url, AsyncLLM) of a uvicorn server in a thread; the AsyncLLM lives
    on uvicorn's loop (the app's lifespan starts it)."""
    import uvicorn

    from conveyor.cluster.openai.app import build_api
    from conveyor.cluster.openai.server import OpenAIServer
    from conveyor.engine.config import build_config
    from conveyor.engine.frontend.async_client import AsyncLLM

    ckpt = tiny_llama
    # A short context keeps every generated request (max_tokens None fills it) quick.
    cfg = build_config({"model": {"path": ckpt, "max_model_len": 96},
                        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
                        "serve": {"served_model_name": "tiny"}})
    llm = AsyncLLM(cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_api(OpenAIServer(llm, cfg), api_key=KEY),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:  # uvicorn sets it once the socket listens
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        yield url, llm
    finally:
        server.should_exit = True
        thread.join(30)
        asyncio.run(llm.shutdown())


def _assert_openai_error(status: int, body: object) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str), err
    assert isinstance(err["code"], str) and (err["param"] is None or isinstance(err["param"], str)), err


def _check(status: int, content: bytes) -> None:
    assert status < 500, f"{status}: {content[:500]!r}"
    if status >= 400:
        _assert_openai_error(status, json.loads(content))
    elif content.startswith(b"event: response."):  # a Responses stream: typed events, no [DONE]
        kinds = [ln[7:] for ln in content.decode().split("\n") if ln.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] in (
            "response.completed", "response.incomplete"), kinds[-3:]
    elif content.startswith(b"data: "):  # a stream: errors go in-band, then [DONE]
        events = [ln[6:] for ln in content.decode().split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for ev in events[:-1]:
            obj = json.loads(ev)
            if "error" in obj:  # an in-band error is the stream's 5xx
                raise AssertionError(f"in-band error: {obj}")


# Fields whose valid values the schema cannot say (unsupported features, the
# served model's name, a prompt the tokenizer/vocab accepts). Steered cases
# drop or fix them so the remaining random fields reach the engine.
_REFUSED = frozenset({"model", "echo", "suffix", "best_of", "logit_bias", "allowed_token_ids", "stream_options",
                      "tools", "tool_choice", "response_format", "text", "previous_response_id"})


def _steer(path: str, body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in _REFUSED}
    if path == "/v1/completions":
        out["prompt"] = "The cat"
    elif path == "/v1/responses":
        out["input"] = "The cat"
    else:
        out["messages"] = [{"role": "user", "content": "hi"}]
    return out


def test_openapi_is_served_behind_the_key(served):
    url, _ = served
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    # Client errors are documented in the OpenAI shape, never as FastAPI's 422.
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and "4XX" in responses
    # FastAPI's own validation answers 400 naming the field, not 422.
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "x", "n": "two"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = httpx.post(f"{url}/v1/completions", headers={**AUTH, "Content-Type": "text/plain"},
                   content=b'{"prompt": "x"}')
    assert r.status_code == 415, r.text
    _assert_openai_error(415, r.json())


def test_schemathesis_no_5xx_and_openai_errors(served):
    from schemathesis import GenerationMode

    url, llm = served
    # Streams are read to the end (schemathesis stops at 64 events by default).
    config = schemathesis.Config.from_dict({"max-stream-events": 100_000})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH, config=config)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    calls: dict[str, int] = {}
    reached = 0  # steered requests the engine answered (so the steer is not dead)
    for op in ops:
        # A GET without parameters has no schema-violating request to make.
        post = op.method == "post"
        for mode, steer in [(GenerationMode.POSITIVE, False)] + (
                [(GenerationMode.POSITIVE, True), (GenerationMode.NEGATIVE, False)] if post else []):
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), derandomize=DERANDOMIZE)
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                nonlocal reached
                if steer and isinstance(case.body, dict):
                    case.body = _steer(op.path, case.body)
                r = case.call(base_url=url, headers=AUTH, timeout=60)
                assert not r.stream_cut_short
                calls[op.path] = calls.get(op.path, 0) + 1
                _check(r.status_code, r.content)
                reached += steer and r.status_code == 200

            fuzz()
    assert calls.get("/v1/completions", 0) >= EXAMPLES_PER_MODE, calls
    assert reached >= EXAMPLES_PER_MODE // 2, reached
    # Healthy and idle afterwards: a normal request works, nothing is left in flight.
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "The cat", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert llm.num_unfinished == 0 and llm.stats.num_running_reqs == 0
    assert llm.stats.kv_cache_usage == 0.0, llm.stats


# ---- hostile values in every field -------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "maxLength": 8}}}}}
TOOL_TURNS = [{"role": "system", "content": "s", "name": "n"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [{
                  "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "r"}]
# Every field with a value of its type, nested objects included, so each leaf gets mutated.
FULL = {
    "/v1/completions": {"prompt": "The cat", "model": "tiny", "max_tokens": 2, "stop": ["x"],
                        "stop_token_ids": [3], "seed": 1, "top_k": 5, "n": 1, "min_tokens": 1,
                        "logprobs": 1, "user": "u", "priority": 0,
                        "structured_outputs": {"choice": ["a", "b"]}},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "n"}],
        "model": "tiny", "max_tokens": 2, "max_completion_tokens": 2, "top_logprobs": 1,
        "logprobs": True, "seed": 1, "stop": "x",
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}}}}}}


def _deep(depth: int) -> list:
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def _leaves(v, path=()):
    """(path, value) of every scalar inside v."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _leaves(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _leaves(x, (*path, i))
    else:
        yield path, v


def _set(body, path, value):
    import copy

    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _hostile_bodies(path: str, props: dict) -> list[dict]:
    """Per leaf of the full body: a lone surrogate for a string, 2^64 and
    -2^63-1 for an integer; per top-level field (the schema's too): all
    three, and nesting 450 deep."""
    base = FULL[path]
    bodies = []
    for p, v in _leaves(base):
        if isinstance(v, str):
            bodies.append(_set(base, p, "x\udc00"))
        elif isinstance(v, int) and not isinstance(v, bool):
            bodies += [_set(base, p, 2**64), _set(base, p, -(2**63) - 1)]
    if path == "/v1/chat/completions":  # these render past the 96-token context: mutated alone
        for field, value in (("tools", [TOOL]), ("messages", TOOL_TURNS)):
            for p, v in _leaves(value):
                if isinstance(v, str):
                    bodies.append({**base, field: _set(value, p, "x\udc00")})
                elif isinstance(v, int):
                    bodies.append({**base, field: _set(value, p, 2**64)})
    for field in set(props) | set(base):
        for value in ("\udc00", 2**64 + 1, _deep(450), {"a": _deep(450)}):
            bodies.append({**base, field: value})
    return bodies


def test_hostile_values_in_every_field_are_4xx_and_the_engine_stays_healthy(served):
    url, llm = served
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    schemas = spec["components"]["schemas"]
    sent = 0
    with httpx.Client(base_url=url, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60) as c:
        for path, name in (("/v1/completions", "CompletionRequest"),
                           ("/v1/chat/completions", "ChatRequest")):
            r = c.post(path, json=FULL[path])
            assert r.status_code == 200, r.text  # the base body is valid
            for body in _hostile_bodies(path, schemas[name]["properties"]):
                r = c.post(path, content=json.dumps(body).encode())
                _check(r.status_code, r.content)
                sent += 1
        # Not UTF-8 in the request id header.
        r = c.post("/v1/completions", json=FULL["/v1/completions"], headers={"X-Request-Id": b"\xff\xfe"})
        _check(r.status_code, r.content)
    assert sent > 150, sent
    # Healthy and truthful afterwards: /health says so and a request proves it.
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "The cat", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert llm.num_unfinished == 0 and llm.client._thread.is_alive()
