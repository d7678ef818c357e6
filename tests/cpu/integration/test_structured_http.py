"""Structured outputs over the OpenAI API (in process, no Ray): the official
client's parse() with a pydantic model, response_format and vLLM's
structured_outputs on both routes, streaming, every error case, batch lines."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from asgi_utils import in_process_api, openai_client, run_on
from pydantic import BaseModel, Field
from structured_schemas import SCHEMAS


class Pet(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    good: bool


@pytest.fixture(scope="module")
def ckpt(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def api(ckpt):
    """(event loop, FastAPI app, AsyncLLM) on one loop for the whole module."""
    yield from in_process_api(ckpt, max_model_len=512)


def _run(api, coro_fn):
    loop, app, _ = api
    return run_on(loop, app, coro_fn)


_openai = openai_client


def _assert_error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert isinstance(err["type"], str) and isinstance(err["code"], str)


def test_openai_parse_with_pydantic_model(api):
    async def go(c):
        client = _openai(c)
        outs = []
        for seed in range(4):
            comp = await client.chat.completions.parse(
                model="tiny", messages=[{"role": "user", "content": "a pet please"}],
                response_format=Pet, temperature=1.0, seed=seed, max_tokens=100)
            outs.append(comp.choices[0])
        return outs
    for choice in _run(api, go):
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)


def test_response_format_and_structured_outputs_both_routes(api):
    schema = SCHEMAS[24]

    async def go(c):
        bodies = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "p", "schema": schema, "strict": True}}}),
            ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": schema}}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "structured_outputs": {"json": schema}}),
            ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": schema}}),
            ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "structured_outputs": {"choice": ["left", "right"]}}),
            ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": 'start: ("a" | "c"){1,3} "b"'}}),
        ]
        return await asyncio.gather(*(c.post(url, json={"model": "tiny", "max_tokens": 120,
                                                        "temperature": 0.0, **b}) for url, b in bodies))
    rs = _run(api, go)
    texts = []
    for r in rs:
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop"
        texts.append(ch["message"]["content"] if "message" in ch else ch["text"])
    for t in texts[:4]:
        jsonschema.validate(json.loads(t), schema)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[4]) and texts[5] in ("left", "right")
    assert re.fullmatch(r"[ac]{1,3}b", texts[6])


def test_schemas_without_additional_properties_are_closed(api, ckpt):
    """pydantic's own schema (no additionalProperties) admits no other keys by
    default; structured_outputs.allow_additional_properties restores JSON
    Schema's open default. A bare {"type": "object"} stays open."""
    import llguidance as llg

    from conveyor.engine.frontend.tokenizer import load_tokenizer
    from conveyor.engine.structured_output.llguidance_backend import LLGuidanceBackend
    from conveyor.engine.structured_output.params import StructuredOutputsParams
    from conveyor.engine.structured_output.schema import close_objects

    schema = Pet.model_json_schema()
    assert "additionalProperties" not in schema
    nested = {"type": "object", "properties": {"p": schema, "free": {"type": "object"}},
              "allOf": [{"properties": {"x": {"type": "object", "properties": {}}}}]}
    closed = close_objects(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"] and "additionalProperties" not in nested
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["allOf"][0]["properties"]["x"]["additionalProperties"] is False
    tok = load_tokenizer(ckpt)

    def admits(allow: bool, text: str) -> bool:
        backend = LLGuidanceBackend(ckpt, 512, None, allow_additional_properties=allow)
        m = llg.LLMatcher(backend.tokenizer, backend.grammar_text(StructuredOutputsParams(json=schema)),
                          log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    extra = '{"name":"rex","age":3,"good":true,"x":1}'
    assert admits(False, extra[:-7] + "}") and not admits(False, extra) and admits(True, extra)

    async def go(c):
        return await _openai(c).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a pet"}], n=4, temperature=1.0, seed=1,
            max_tokens=100, response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    for ch in _run(api, go).choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), {**schema, "additionalProperties": False})


def test_json_object_and_text(api):
    async def go(c):
        a = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "json"}], "max_tokens": 400, "temperature": 0.0,
            "response_format": {"type": "json_object"}})
        b = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                  "response_format": {"type": "text"}})
        return a, b
    a, b = _run(api, go)
    assert a.status_code == 200 and b.status_code == 200
    ch = a.json()["choices"][0]
    text = ch["message"]["content"]
    assert text.startswith("{")
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_streamed_structured_output_concatenates(api):
    schema = SCHEMAS[25]

    async def go(c):
        client = _openai(c)
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "stream"}], stream=True,
            max_tokens=150, temperature=1.0, seed=5, stream_options={"include_usage": True},
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        parts, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return "".join(parts), finish, usage
    text, finish, usage = _run(api, go)
    assert finish == "stop" and usage.completion_tokens > 0
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(("}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_errors_are_400_naming_the_field(api, body, param):
    _, _, llm = api

    async def go(c):
        chat = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], **body})
        cmpl = await c.post("/v1/completions", json={"prompt": "x", **body})
        ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return chat, cmpl, ok
    chat, cmpl, ok = _run(api, go)
    _assert_error(chat, param)
    _assert_error(cmpl, param)
    assert ok.status_code == 200 and llm.num_unfinished == 0


def test_structured_metrics(api):
    from conveyor.cluster.openai.metrics import ServeMetrics

    _, _, llm = api
    text = ServeMetrics(llm, "tiny").render().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("conveyor:structured_output"):
            name, v = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(v)
    # The module's earlier tests sent structured requests (parse, both routes, streaming).
    assert values["conveyor:structured_output_requests_total"] >= 10
    assert values["conveyor:structured_output_grammar_compile_seconds_count"] >= 10
    assert values["conveyor:structured_output_bitmask_seconds_count"] >= 10
    assert 0 < values["conveyor:structured_output_bitmask_seconds_sum"] < 60


def test_batch_lines_with_structured_bodies(tmp_path, ckpt):
    from conveyor.cluster.batch.job import main

    schema = SCHEMAS[1]
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(json.dumps({"model": {"path": ckpt, "max_model_len": 512},
                               "parallel": {"executor": "mp"}, "serve": {"served_model_name": "tiny"}}))
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 80,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi", "max_tokens": 20, "structured_outputs": {"choice": ["up", "down"]}}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi", "structured_outputs": {"regex": "(("}}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["--config", str(cfg), "--input", str(inp), "--output", str(out), "--no-progress"]) == 0
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    a = recs["a"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(a), schema)
    assert recs["b"]["response"]["body"]["choices"][0]["text"] in ("up", "down")
    assert recs["c"]["response"]["status_code"] == 400
    assert recs["c"]["response"]["body"]["error"]["param"] == "structured_outputs"
